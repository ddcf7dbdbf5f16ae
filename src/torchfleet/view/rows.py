"""A run's per-rank rows, as the metrics files hold them and the live view receives them.

Three kinds of row are read; every other row (a "train" row's loss, a "val"
row) is passed over:

    rank       one rank's figures for one log window: the fields of the record
               (record.py declares them; a row is read with its `needed` ones,
               those files held before the rest were added);
               torchfleet.run_services.rank_figures says how each is measured
    straggler  a verdict: step, rank, host, phase (data, compute,
               communication, memory or membership), value, median, slower,
               windows and message, the line the main rank printed
               (torchfleet.run_services.stragglers)
    membership the replica groups in the quorum: a "train" row's participants
               column, a row of kind "membership" with step and participants,
               or a verdict of phase membership (value: the groups after)

CSV cells are text and empty where a row has no such column; each field is
converted here, so a row from a CSV file, a JSON line or the live run is the
same dict.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from torchfleet.errors import UsageError
from torchfleet.view import record

RANK_FIELDS = record.needed()
VERDICT_FIELDS = ("step", "rank", "host", "phase", "value", "median", "slower", "windows", "message")
_NUMBERS = record.types()
_INTS = {name for name, kind in _NUMBERS.items() if kind is int} | {"windows", "participants"}
_FLOATS = {name for name, kind in _NUMBERS.items() if kind is float} | {"value", "median", "slower", "elapsed_s"}
FORMATS = (".jsonl", ".json", ".csv")


def _number(name: str, value):
    """`value` as its field's type; None where the cell is empty (a CSV row of another kind)."""
    if value is None or value == "":
        return None
    if name in _INTS:
        return int(float(value))  # "12.0" from a CSV written by hand
    if name in _FLOATS:
        return float(value)
    return value


def clean(row: Mapping) -> dict:
    """`row` with its numeric fields as numbers and empty cells dropped."""
    out = {}
    for name, value in row.items():
        try:
            converted = _number(name, value)
        except (TypeError, ValueError):
            converted = None  # a cell that is not a number is treated as missing, not a crash mid-run
        if converted is not None:
            out[name] = converted
    return out


class RunRows:
    """The rows of one run so far, sorted by kind: `ranks` (rank: its windows in step order),
    `verdicts` (in the order named) and `groups` ((step, participants) points)."""

    def __init__(self) -> None:
        self.ranks: dict[int, list[dict]] = {}
        self.verdicts: list[dict] = []
        self.groups: list[tuple[int, int]] = []

    def add(self, rows: Iterable[Mapping]) -> int:
        """Take `rows` (any kinds; those this view does not draw are passed over); how many were taken."""
        taken = 0
        for raw in rows:
            row = clean(raw)
            kind = row["kind"] = row.get("kind") or _kind(row)
            if kind == "rank" and all(f in row for f in RANK_FIELDS):
                self._rank(row)
            elif kind == "straggler" and "phase" in row and "step" in row:
                self.verdicts.append(row)
                if row["phase"] == "membership" and "value" in row:
                    self._group(row["step"], int(row["value"]))
            elif kind in ("train", "membership") and "participants" in row and "step" in row:
                self._group(row["step"], row["participants"])
            else:
                continue
            taken += 1
        return taken

    def _rank(self, row: dict) -> None:
        windows = self.ranks.setdefault(row["rank"], [])
        if windows and windows[-1]["step"] >= row["step"]:  # a resumed run writes its steps again
            while windows and windows[-1]["step"] >= row["step"]:
                windows.pop()
        windows.append(row)

    def _group(self, step: int, participants: int) -> None:
        if not self.groups or self.groups[-1] != (step, participants):
            self.groups.append((step, participants))

    def copy(self) -> RunRows:
        """A copy that later rows leave as it is (rows themselves are never changed once taken)."""
        other = RunRows()
        other.ranks = {rank: list(windows) for rank, windows in self.ranks.items()}
        other.verdicts, other.groups = list(self.verdicts), list(self.groups)
        return other

    def latest(self) -> list[dict]:
        """Each rank's last window, by rank."""
        return [self.ranks[r][-1] for r in sorted(self.ranks)]

    @property
    def last_step(self) -> int | None:
        return max((w[-1]["step"] for w in self.ranks.values()), default=None)

    def memory_kind(self) -> str:
        kinds = {w["memory_kind"] for windows in self.ranks.values() for w in windows if "memory_kind" in w}
        return kinds.pop() if len(kinds) == 1 else "mixed"


def _kind(row: dict) -> str | None:
    """The kind of a row handed over without one: RankWindow.row() and Verdict.row() as the loop holds them."""
    if all(f in row for f in RANK_FIELDS):
        return "rank"
    return "straggler" if "phase" in row else None


def read_metrics(path: Path) -> RunRows:
    """The rows of a --metrics-out file (.jsonl, .json or .csv); refused in one sentence when it holds no
    rank rows, or cannot be read as its suffix says."""
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise UsageError(f"{str(path)!r} is not a metrics file; give the .jsonl or .csv file that --metrics-out wrote")
    rows = RunRows()
    try:
        with path.open(newline="") as f:
            if suffix == ".csv":
                rows.add(csv.DictReader(f))
            else:
                rows.add(_json_lines(f.read().splitlines()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as exc:
        raise UsageError(f"{str(path)!r} cannot be read as a {suffix[1:]} metrics file ({exc})") from None
    if not rows.ranks:
        raise UsageError(
            f'{str(path)!r} holds no per-rank rows (kind "rank"); they are written by a run of several'
            " processes with --metrics-out"
        )
    return rows


def _json_lines(lines: list[str]) -> list[dict]:
    """The objects of JSON lines; a last line cut short (its run was killed while writing it) is left out."""
    lines = [line for line in lines if line.strip()]
    objects = []
    for n, line in enumerate(lines):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                break
            raise
        if isinstance(value, dict):
            objects.append(value)
    return objects
