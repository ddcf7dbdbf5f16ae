"""The terminal's live view: one row per rank, redrawn in place each log window (rich, as the summary).

Each window the main rank hands the table its ranks' rows and the verdicts
named in it (rows.py). A rank named a straggler keeps its marker for `hold`
windows after the verdict: a verdict is named once per streak
(torchfleet.run_services.stragglers), and a marker that lasted one redraw would be missed.
A replica group leaving or joining is the table's caption.

Used alone, `with table.live(): ... table.update(rows, verdicts)` draws it
under its own rich.live.Live. Beside the step bar, which is a Live of its
own, and rich allows one at a time, put both in one Live instead:
``Live(Group(progress, table))`` (a table is a renderable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

from rich.console import Console
from rich.live import Live
from rich.table import Table

from torchfleet.view import record
from torchfleet.view.rows import clean


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


def _cell(value, how: record.Figure, total: float) -> str:
    """A field's value as the table shows it, by its unit; a phase with its share of the step's `total`."""
    if value is None:
        return ""
    if how.unit == "bytes":
        return _mib(value)
    if how.unit != "s":
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    share = f" ({value / total:.0%})" if how.phase and total > 0 else ""
    return _ms(value) + share


class RankTable:
    """The ranks' latest window as a rich table; `update` takes a window's rows, `live` shows it in place."""

    def __init__(self, hold: int = 3, console: Console | None = None):
        self.hold = hold
        self.console = console or Console()
        self._rows: dict[int, dict] = {}
        self._marks: dict[int, tuple[str, int]] = {}  # rank: (what it was named for, windows left)
        self._caption = ""
        self._live: Live | None = None

    @property
    def has_rows(self) -> bool:
        return bool(self._rows)

    def update(self, ranks: Iterable[Mapping], verdicts: Iterable[Mapping] = ()) -> None:
        """One log window: every rank's row (kind "rank") and the verdicts named in it (kind "straggler")."""
        self._marks = {r: (what, left - 1) for r, (what, left) in self._marks.items() if left > 1}
        for row in map(clean, ranks):
            self._rows[row["rank"]] = row
        for verdict in map(clean, verdicts):
            if verdict.get("phase") == "membership":
                self._caption = verdict.get("message", "")
            else:
                what = "memory growing" if verdict.get("phase") == "memory" else f"slow in {verdict.get('phase')}"
                self._marks[verdict["rank"]] = (what, self.hold)
        if self._live is not None:
            self._live.update(self.render(), refresh=True)

    def render(self) -> Table:
        """The table as it stands: the record's columns (rank, host, step time, each phase with its share of
        the step, memory), then the marker."""
        step = max((row["step"] for row in self._rows.values()), default=None)
        title = "ranks" if step is None else f"ranks at step {step}"
        table = Table(title=title, title_justify="left", caption=self._caption or None, caption_justify="left")
        how, kinds = record.figures(), record.types()
        columns = record.columns()
        for n, (name, title) in enumerate(columns):  # the first names the row
            table.add_column(title, justify="right" if kinds[name] else "left", style="bold" if n == 0 else None)
        table.add_column("straggler")
        for rank in sorted(self._rows):
            row = self._rows[rank]
            total = sum(row.get(field, 0.0) for field in record.phases().values())
            mark = self._marks.get(rank)
            table.add_row(
                *(_cell(row.get(name), how[name], total) for name, _ in columns),
                f"<< {mark[0]}" if mark else "",
                style="red" if mark else None,
            )
        return table

    def __rich__(self) -> Table:
        return self.render()

    @contextlib.contextmanager
    def live(self) -> Iterator[RankTable]:
        """Draw the table in place under rich.live.Live until the block ends (the last state stays)."""
        with Live(self.render(), console=self.console, auto_refresh=False) as live:
            self._live = live
            try:
                yield self
            finally:
                self._live = None
