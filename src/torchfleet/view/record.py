"""The per-rank record, declared once: RankWindow, each rank's figures for one log window.

Each field says, in its `figure(...)`, what the services do with it:

    sends    the numbers each rank puts in the one all-gather for it, by name
             (run_services/rank_figures.py measures them); the gathered
             vector is every name of every field, in declaration order, each
             once
    derive   how the field's value comes from what its rank sent (and, for a
             host's figure, what the ranks of its host sent); a field that
             neither sends nor derives is given by the main rank (the step,
             the rank, its host, the kind of memory read)
    unit     "s" (seconds per step: milliseconds in the table and on the
             page), "bytes" (MiB), or none (a count, a name)
    column   its title in the terminal table (view/table.py); `place` orders
             the table's columns and the page's charts alike
    phase    the part of the step it is: the straggler rules judge it
             (run_services/stragglers.py), the table shows its share of the
             step, the page stacks it with the other phases
    chart    (id, title) of the page's line chart that draws it per rank over
             the steps (view/figures.py), and TensorBoard's rank<r>/<field>
    needed   a row of kind "rank" is read only with it: the fields that files
             written before the others were added already hold

The metrics files' columns are the fields' names in declaration order
(run_services/metrics.py). Adding a field here is adding it to the gather, the
files, the table, the page and the rules: nothing else lists the fields. Only
a number no rank measures yet needs more: its measurement, in
run_services/rank_figures.py (`pack` refuses what does not match the record).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, get_type_hints

Sent = Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Figure:
    """What the services do with one field of the record (the module says what each part means)."""

    sends: tuple[str, ...] = ()
    derive: Callable[[Sent, list[Sent]], Any] | None = None
    unit: str = ""
    column: str = ""
    place: float = math.inf
    phase: str = ""
    chart: tuple[str, str] | None = None
    needed: bool = False


def figure(default: Any = dataclasses.MISSING, **how: Any) -> Any:
    """A field of the record, with what the services do with it (`how`: Figure's parts)."""
    return dataclasses.field(default=default, metadata={"figure": Figure(**how)})


def _per_step(*names: str) -> Callable[[Sent, list[Sent]], float]:
    """The sum of `names` sent, per step of the window."""
    return lambda mine, _host: sum(mine[n] for n in names) / max(mine["steps"], 1.0)


def _wait(mine: Sent, _host: list[Sent]) -> float | None:
    return None if math.isnan(mine["wait_s"]) else mine["wait_s"] / max(mine["steps"], 1.0)


def _others_cores(_mine: Sent, host: list[Sent]) -> float | None:
    """The host's cores that other processes kept busy over the window: its busy CPU-seconds per second (the
    median of its ranks' readings) less its ranks' own CPU-seconds per second."""
    busy = [r["busy_s"] / r["wall_s"] for r in host if r["wall_s"] > 0 and not math.isnan(r["busy_s"])]
    if len(busy) < len(host):
        return None
    ours = sum(r["cpu_s"] / r["wall_s"] for r in host)
    return max(0.0, sorted(busy)[len(busy) // 2] - ours)


@dataclasses.dataclass(frozen=True)
class RankWindow:
    """One rank's figures for one log window: the per-rank record that the metrics files, the straggler
    verdicts (run_services/stragglers.py) and any live view read. Times are seconds per step (means over the
    window's steps); `memory_bytes` is as run_services/rank_figures.py says (`memory_kind`:
    "cuda_max_allocated" or "rss")."""

    step: int = figure(needed=True)  # the window's last step
    rank: int = figure(column="rank", place=0, needed=True)
    host: str = figure(column="host", place=1, needed=True)
    steps: int = figure(sends=("steps",), derive=lambda mine, _: int(mine["steps"]), needed=True)  # in the window
    data_s: float = figure(
        sends=("data",), derive=_per_step("data"), unit="s", column="data ms", place=3, phase="data", needed=True
    )
    compute_s: float = figure(
        sends=("compute",),
        derive=_per_step("compute"),
        unit="s",
        column="compute ms",
        place=4,
        phase="compute",
        needed=True,
    )
    comm_s: float = figure(
        sends=("comm",),
        derive=_per_step("comm"),
        unit="s",
        column="comm ms",
        place=5,
        phase="communication",
        needed=True,
    )
    step_s: float = figure(
        derive=_per_step("data", "compute", "comm"),
        unit="s",
        column="step ms",
        place=2,
        chart=("step", "step time per rank"),
        needed=True,
    )
    memory_bytes: int = figure(
        sends=("memory",),
        derive=lambda mine, _: int(mine["memory"]),
        unit="bytes",
        column="memory",
        place=6,
        chart=("memory", "memory per rank"),
        needed=True,
    )
    memory_kind: str = figure()
    # seconds per step its main thread waited, ready to run, for a CPU
    cpu_wait_s: float | None = figure(None, sends=("wait_s",), derive=_wait, unit="s")
    others_cores: float | None = figure(None, sends=("cpu_s", "busy_s", "wall_s"), derive=_others_cores)
    host_cores: int = figure(0, sends=("cores",), derive=lambda mine, _: int(mine["cores"]))  # its host's CPUs

    def row(self) -> dict:
        """The record as a metrics row's fields (kind "rank")."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def figures(record: type = RankWindow) -> dict[str, Figure]:
    """Every field of `record`, in declaration order, with what the services do with it."""
    return {f.name: f.metadata.get("figure", Figure()) for f in dataclasses.fields(record)}


def sent(record: type = RankWindow) -> tuple[str, ...]:
    """The names of the numbers each rank sends, in the gathered vector's order."""
    return tuple(dict.fromkeys(name for how in figures(record).values() for name in how.sends))


def pack(values: Mapping[str, float], record: type = RankWindow) -> list[float]:
    """`values` (a rank's measurements by name) as the vector it sends: every name `record` sends, in order."""
    names = sent(record)
    if set(values) != set(names):
        raise ValueError(
            f"a rank measured {sorted(values)} but the record sends {sorted(names)}: measure what its fields send"
        )
    return [float(values[n]) for n in names]


def phases(record: type = RankWindow) -> dict[str, str]:
    """The step's phases: name (data, compute, communication) to field, in declaration order."""
    return {how.phase: name for name, how in figures(record).items() if how.phase}


def charts(record: type = RankWindow) -> dict[str, tuple[str, str]]:
    """The page's line charts: their id to (field, title), in `place` order."""
    drawn = sorted((how.place, name, how.chart) for name, how in figures(record).items() if how.chart)
    return {chart[0]: (name, chart[1]) for _, name, chart in drawn}


def columns(record: type = RankWindow) -> list[tuple[str, str]]:
    """The terminal table's columns: (field, title), in `place` order."""
    shown = [(how.place, n, name, how.column) for n, (name, how) in enumerate(figures(record).items()) if how.column]
    return [(name, title) for *_, name, title in sorted(shown)]


def needed(record: type = RankWindow) -> tuple[str, ...]:
    """The fields a row of kind "rank" must hold to be read."""
    return tuple(name for name, how in figures(record).items() if how.needed)


def types(record: type = RankWindow) -> dict[str, type[int] | type[float] | None]:
    """Each field's number type, int or float (None where it is text)."""
    hints = get_type_hints(record)
    return {
        name: next((t for t in (int, float) if t == hint or t in getattr(hint, "__args__", ())), None)
        for name, hint in hints.items()
    }


def windows(
    step: int, rows: list[list[float]], host_names: list[str], memory_kind: str, record: type = RankWindow
) -> list:
    """The ranks' records from what each sent (`pack`'s vectors, by rank)."""
    names, how_each = sent(record), figures(record)
    mine = [dict(zip(names, row, strict=True)) for row in rows]
    on_host: dict[str, list[Sent]] = {}
    for values, host in zip(mine, host_names, strict=True):
        on_host.setdefault(host, []).append(values)
    records = []
    for rank, values in enumerate(mine):
        given = {"step": step, "rank": rank, "host": host_names[rank], "memory_kind": memory_kind}
        host = on_host[host_names[rank]]
        made = {name: how.derive(values, host) if how.derive else given[name] for name, how in how_each.items()}
        records.append(record(**made))
    return records
