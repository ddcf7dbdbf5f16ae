"""What the main rank shows: a progress bar while training, a summary after."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from torchfleet.strategies.expert_load import summary as expert_summary
from torchfleet.view.table import RankTable

console = Console(stderr=False)


class _BarAndRanks(Progress):
    """The step bar with the ranks' table under it, in the one live display rich allows at a time."""

    ranks: RankTable | None = None

    def get_renderables(self):
        yield from super().get_renderables()
        if self.ranks is not None and self.ranks.has_rows:
            yield self.ranks


class StepBar:
    def __init__(self, progress: Progress | None, task):
        self._progress, self._task = progress, task

    def ranks(self, rows: list[dict], verdicts: list[dict]) -> None:
        """A log window's per-rank rows and verdicts, shown in the table under the bar (a terminal's only)."""
        if isinstance(self._progress, _BarAndRanks):
            if self._progress.ranks is None:
                self._progress.ranks = RankTable()
            self._progress.ranks.update(rows, verdicts)

    def advance(self, epoch: int, loss: float | None = None, steps: int = 1, groups: str | None = None) -> None:
        """`steps` more done; `loss` only when the trainer read one (every --log-every steps); `groups`
        under replica groups: those in the step's quorum, "2/3"."""
        if self._progress is not None:
            shown: dict[str, Any] = {} if loss is None else {"loss": f"{loss:.4f}"}  # a column's field
            if groups is not None:
                shown["groups"] = groups
            self._progress.update(self._task, advance=steps, epoch=epoch, **shown)

    def at(self, step: int) -> None:
        """Back or forward to `step` (a replica group's step that did not commit, or a group that healed)."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def note(self, line: str) -> None:
        """A line above the bar (printed plainly without one: the caller is the main rank)."""
        if self._progress is not None:
            self._progress.console.print(line, markup=False)
        else:
            print(line, flush=True)

    def epoch_done(self, epoch: int, figures: dict) -> None:
        if self._progress is not None:
            self._progress.console.print(f"epoch {epoch}: {describe(figures)}")


def describe(figures: dict) -> str:
    """Validation figures in words: 'validation accuracy 0.9712', or for gpt
    'validation loss 2.1034, perplexity 8.19'."""
    if not figures:  # --data PATH without a validation set
        return "no validation set"
    if "val_loss" in figures:
        return f"validation loss {figures['val_loss']:.4f}, perplexity {figures['val_perplexity']:.2f}"
    return f"validation accuracy {figures.get('val_accuracy', float('nan')):.4f}"


@contextlib.contextmanager
def progress(enabled: bool, total: int, done: int = 0, groups: bool = False) -> Iterator[StepBar]:
    """A step bar with epoch and loss (and, with `groups`, the replica groups in each step's quorum);
    a silent stand-in on other ranks."""
    if not enabled:
        yield StepBar(None, None)
        return
    columns = (
        TextColumn("epoch {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        *((TextColumn("groups {task.fields[groups]}"),) if groups else ()),
        TimeRemainingColumn(),
    )
    # A non-terminal (CI logs, pipes) gets the epoch lines without redraws.
    with _BarAndRanks(*columns, console=console, transient=True, disable=not sys.stdout.isatty()) as bar:
        task = bar.add_task("train", total=total, completed=done, epoch=0, loss="-", groups="-")
        yield StepBar(bar, task)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_bytes(v)}" for k, v in value.items())
    if isinstance(value, list):
        return " ".join(_fmt(v) for v in value)
    return str(value)


def _bytes(n) -> str:
    if not isinstance(n, (int, float)):
        return str(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_ROWS = (
    ("strategy", "strategy"),
    ("processes", "world_size"),
    ("backend", "backend"),
    ("precision", "precision"),
    ("model", "model"),
    ("gpt preset", "gpt_preset"),
    ("epochs", "epochs"),
    ("steps", "steps"),
    ("global batch", "global_batch"),
    ("final loss", "final_loss"),
    ("validation accuracy", "val_accuracy"),
    ("validation loss", "val_loss"),
    ("validation perplexity", "val_perplexity"),
    ("samples/s", "samples_per_s"),
    ("tokens/s", "tokens_per_s"),
    ("wall time (s)", "wall_s"),
    ("replica group", "replica_group"),
    ("groups at the end", "replica_groups"),
    ("pauses when groups left (s)", "replica_pauses_s"),
)
_PIPELINE_ROWS = (
    ("pipeline schedule", "schedule"),
    ("stages x replicas", None),
    ("micro-batches", "microbatches"),
    ("layers per stage", "layers_per_stage"),
    ("bubble, the schedule's formula", "bubble_formula"),
    ("bubble measured (per process)", "bubble_measured"),
)


def summary(result: dict) -> None:
    table = Table(title="torchfleet train", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, key in _ROWS:
        if key in result:
            table.add_row(label, _fmt(result[key]))
    # Sharded and pipelined strategies: what each rank holds, one row per rank.
    for rank, held in result.get("memory_per_rank", {}).items():
        table.add_row(f"memory {rank}", _fmt(held) if isinstance(held, dict) else _bytes(held))
    if result.get("expert_load"):
        table.add_row("tokens per expert", expert_summary(result["expert_load"]))
    pipe = result.get("pipeline", {})
    for label, key in _PIPELINE_ROWS if pipe else ():
        table.add_row(label, f"{pipe['stages']} x {pipe['replicas']}" if key is None else _fmt(pipe[key]))
    console.print(table)
    if result.get("backend_reason") and result.get("backend") != "none":
        console.print(f"backend {result['backend']}: {result['backend_reason']}", markup=False)
