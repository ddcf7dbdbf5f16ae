"""What a training run looked like, for people and plots: a CSV or JSON-lines file, TensorBoard events.

`--metrics-out FILE` gets one row per logged step (kind "train": step,
epoch, the mean loss since the last row, the learning rate, samples/s since
the last row, seconds since the start) and one per epoch (kind "val": the
validation figures the task reports, accuracy or loss and perplexity).
`--tensorboard DIR` gets the same scalars, as train/loss, train/lr,
train/samples_per_s and val/<figure>. The main rank writes; each row is
flushed as it is written, so a run that dies keeps every row before it.

A run of several processes also gets, at each logged step, one row per rank
(kind "rank": the fields of the per-rank record, view/record.py, in the order
declared there: rank, host, steps, data_s, compute_s, comm_s and step_s in
seconds per step over the log window, memory and more; what each means is in
run_services/rank_figures.py), its phases and charted figures as
rank<r>/<figure> scalars in TensorBoard, a row for
each straggler verdict (kind "straggler": rank, host, phase, value, median,
slower, windows, cpu_wait_s and others_wait_s in data and compute, for a slow
link send_mb_s and others_mb_s, and the message printed; run_services/stragglers.py),
which TensorBoard gets as text under "stragglers", and a row when the machine
is busy for every rank (kind "machine": step, windows, wait_low, wait_high,
others_cores, host_cores, message).

A resumed run continues the file: the rows up to the checkpoint's step are
kept and those after it, which the resumed run computes again, are dropped
(TensorBoard's purge_step does the same for its events).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import time
from pathlib import Path

from torchfleet import outputs
from torchfleet.errors import UsageError
from torchfleet.run_services.stragglers import MachineBusy, Verdict
from torchfleet.view import record as rank_record

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}
TRAIN_COLUMNS = ("kind", "step", "epoch", "loss", "lr", "samples_per_s", "elapsed_s")
# A "rank" row's columns are the record's fields (view/record.py), a "straggler" or "machine" row's those of
# stragglers.Verdict and MachineBusy, each column once, in the order first declared.
RANK_COLUMNS = tuple(name for name in rank_record.figures() if name not in TRAIN_COLUMNS)
VERDICT_COLUMNS = tuple(
    dict.fromkeys(
        name
        for name in (*(f.name for kind in (Verdict, MachineBusy) for f in dataclasses.fields(kind)), "message")
        if name not in (*TRAIN_COLUMNS, *RANK_COLUMNS)
    )
)
# TensorBoard's per-rank scalars: the figures the page draws.
RANK_SCALARS = tuple(name for name, how in rank_record.figures().items() if how.phase or how.chart)


def check_metrics_out(path: str) -> None:
    """The file's format comes from its suffix; refuse one that names no format."""
    if Path(path).suffix.lower() not in FORMATS:
        raise UsageError(
            f"--metrics-out {path!r} must end in .csv (a table with a header) or .jsonl"
            " (JSON lines; .json is read the same way)"
        )


def check_tensorboard() -> None:
    """TensorBoard is optional (the `tensorboard` extra): say how to get it before any training."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError(
            "--tensorboard needs the tensorboard package, which is not installed;"
            " run `pip install tensorboard` (or `pip install 'torchfleet[tensorboard]'`)"
        )


class MetricsLog:
    """Rows to a file and scalars to TensorBoard; with neither, every call does nothing (other ranks).

    `figures`: the names of the validation figures (the file's columns for
    "val" rows). `start_step`: the step a resumed run starts from (0: a new
    run, which replaces the file). `extras`: more columns of "train" rows
    (under replica groups: "participants", the groups in the step's quorum).
    `per_rank`: the columns of "rank" and "straggler" rows too (a run of
    several processes).
    """

    def __init__(
        self,
        path: str | None = None,
        tensorboard: str | None = None,
        figures: tuple = (),
        start_step: int = 0,
        extras: tuple = (),
        per_rank: bool = False,
    ):
        columns = TRAIN_COLUMNS + tuple(extras) + ((*RANK_COLUMNS, *VERDICT_COLUMNS) if per_rank else ())
        self._columns = columns + tuple(f for f in figures if f not in columns)
        self._file = self._csv = self._tb = None
        self._evaluated: set[float] = set()  # steps whose "val" row the resumed file already holds
        if path:
            self._format = FORMATS[Path(path).suffix.lower()]
            if start_step:
                self._keep_until(Path(path), start_step)
            self._file = open(path, "a" if start_step else "w", newline="")
            if self._format == "csv":
                self._csv = csv.DictWriter(self._file, self._columns)
                if self._file.tell() == 0:  # a new file, or a resumed run's that had no rows yet
                    self._csv.writeheader()
        if tensorboard:
            check_tensorboard()
            # Here, not at the top: it imports tensorboard, which only this flag needs.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard, purge_step=start_step + 1 if start_step else None)
        self._start = self._last_time = time.perf_counter()
        self._last_samples = 0

    def step(self, step: int, epoch: int, loss: float, lr: float, samples: int, **extras: float) -> None:
        """A logged step: `loss` the mean since the last one, `samples` this run's total so far."""
        if self._file is None and self._tb is None:
            return
        now = time.perf_counter()
        rate = (samples - self._last_samples) / (now - self._last_time) if now > self._last_time else 0.0
        self._last_time, self._last_samples = now, samples
        lr = float(lr)
        self._write(
            {
                "kind": "train",
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "samples_per_s": rate,
                "elapsed_s": now - self._start,
                **extras,
            }
        )
        for name, value in (("loss", loss), ("lr", lr), ("samples_per_s", rate), *extras.items()):
            self._scalar(f"train/{name}", value, step)

    def ranks(self, records: list) -> None:
        """Every rank's figures of the window that ended at a logged step (rank_figures.RankWindow each)."""
        if self._file is None and self._tb is None:
            return
        elapsed = time.perf_counter() - self._start
        for record in records:
            self._write({"kind": "rank", **record.row(), "elapsed_s": elapsed})
            for name in RANK_SCALARS:
                self._scalar(f"rank{record.rank}/{name}", getattr(record, name), record.step)

    def verdict(self, verdict) -> None:
        """A straggler named (stragglers.Verdict)."""
        if self._file is None and self._tb is None:
            return
        self._write({"kind": "straggler", **verdict.row(), "elapsed_s": time.perf_counter() - self._start})
        if self._tb is not None:
            self._tb.add_text("stragglers", verdict.line(), verdict.step)

    def machine(self, note) -> None:
        """Every rank waited for a CPU (stragglers.MachineBusy)."""
        if self._file is None and self._tb is None:
            return
        self._write({"kind": "machine", **note.row(), "elapsed_s": time.perf_counter() - self._start})
        if self._tb is not None:
            self._tb.add_text("stragglers", note.line(), note.step)

    def epoch(self, step: int, epoch: int, figures: dict) -> None:
        """An epoch's validation figures, at the step the epoch ended."""
        if (self._file is None and self._tb is None) or step in self._evaluated:
            return  # a run resumed at an epoch's end evaluates the same weights again: the row is there
        now = time.perf_counter()
        self._write({"kind": "val", "step": step, "epoch": epoch, "elapsed_s": now - self._start, **figures})
        for name, value in figures.items():
            self._scalar(f"val/{name.removeprefix('val_')}", value, step)
        self._last_time = now  # samples/s counts training time: the evaluation is left out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        self._file = self._tb = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # also when training stops with an error: TensorBoard flushes what it holds

    def _write(self, row: dict) -> None:
        if self._file is None:
            return
        if self._csv is not None:
            self._csv.writerow(row)
        else:  # JSON has no NaN or Infinity: a diverged figure is null
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if self._tb is not None:
            self._tb.add_scalar(tag, value, step)

    def _keep_until(self, path: Path, step: int) -> None:
        """Drop the rows after `step`: a restart from that checkpoint writes them again."""
        if not path.exists():
            return
        lines = path.read_text().splitlines(keepends=True)
        header = lines[:1] if self._format == "csv" else []
        if header and next(csv.reader(header)) != list(self._columns):
            raise UsageError(
                f"--metrics-out {str(path)!r} has other columns than this run writes"
                f" ({', '.join(self._columns)}); give a new file to resume into"
            )
        body = lines[len(header) :]
        rows = [_kind_and_step(line, self._format) for line in body]
        kept = [line for line, (_, at) in zip(body, rows, strict=True) if at <= step]
        self._evaluated = {at for kind, at in rows if kind == "val" and at <= step}
        if len(kept) < len(body):
            outputs.write_text(path, "".join(header + kept), "--metrics-out")


def _kind_and_step(line: str, form: str) -> tuple[str, float]:
    """A row's kind and step; a row cut short (its run was killed while writing it) is past every step."""
    if not line.endswith("\n"):  # every row is written with its newline
        return "", math.inf
    try:
        if form == "jsonl":
            row = json.loads(line)
            return row["kind"], row["step"]
        cells = next(csv.reader([line]))
        return cells[0], int(cells[1])
    except (ValueError, KeyError, IndexError, StopIteration):
        return "", math.inf
