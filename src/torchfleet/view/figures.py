"""The page's charts as plotly figures, from a run's rows: the live page and the report draw the same ones.

    step      step time per rank over the steps, with a mark where a rank was named
    phases    each rank's step split into data, compute and communication
    memory    memory per rank over the steps
    groups    the replica groups in the quorum over the steps (a note where the run had none)

The line charts (step, memory) are the record's fields that name a chart, and
the phases its fields that are phases (record.py): `CHARTS` are their ids, in
the order of the fields' places, and groups last.

`payload` is what the page receives: each figure as plotly's JSON, the
verdicts' lines and a status line. plotly draws; this module only sorts the
rows into traces.
"""

from __future__ import annotations

import json
import math

from torchfleet.view import record
from torchfleet.view.rows import RunRows

MIB = 1 << 20
PHASE_TRACES = tuple(record.phases().items())
MEMORY_TITLES = {"cuda_max_allocated": "CUDA peak allocated (MiB)", "rss": "resident set (MiB)"}
HEIGHT = 360
# What a unit is drawn in: (the axis's title, the factor from the field's value); a count as it is.
SCALES = {"s": ("ms per step", 1e3), "bytes": ("MiB", 1 / MIB)}


def _charts() -> tuple[str, ...]:
    """The page's charts, by id: the record's line charts and its phases, in the order of their fields' places."""
    how = record.figures()
    places = {chart: how[field].place for chart, (field, _) in record.charts().items()}
    places["phases"] = min((how[field].place for field in record.phases().values()), default=math.inf)
    return (*sorted(places, key=lambda chart: places[chart]), "groups")


CHARTS = _charts()


def _layout(title: str, x: str, y: str, **more) -> dict:
    return {
        "title": {"text": title},
        "xaxis": {"title": {"text": x}},
        "yaxis": {"title": {"text": y}, "rangemode": "tozero"},
        "height": HEIGHT,
        "margin": {"l": 60, "r": 20, "t": 50, "b": 50},
        "template": "plotly_white",
        **more,
    }


def rank_name(windows: list[dict]) -> str:
    return f"rank {windows[-1]['rank']} ({windows[-1]['host']})"


def _color(rank: int) -> str:
    from plotly.colors import qualitative

    return qualitative.Plotly[rank % len(qualitative.Plotly)]


def line_figure(rows: RunRows, field: str, title: str):
    """`field` per rank over the steps; on the step chart, a mark where a rank was named."""
    import plotly.graph_objects as go

    axis, scale = SCALES.get(record.figures()[field].unit, (field, 1.0))
    if record.figures()[field].unit == "bytes":  # what kind of memory the run read
        axis = MEMORY_TITLES.get(rows.memory_kind(), "memory (MiB)")
    fig = go.Figure(layout=_layout(title, "step", axis))
    for rank, windows in sorted(rows.ranks.items()):
        fig.add_scatter(
            x=[w["step"] for w in windows],
            y=[_scaled(w.get(field), scale) for w in windows],
            name=rank_name(windows),
            legendgroup=str(rank),
            mode="lines+markers",
            line={"color": _color(rank)},
        )
    named = [v for v in rows.verdicts if v.get("phase") not in ("membership", None) and v.get("rank") in rows.ranks]
    if named and field == record.charts()["step"][0]:  # each verdict marked on its rank's line, the sentence on hover
        at = [_window_at(rows.ranks[v["rank"]], v["step"]) for v in named]
        fig.add_scatter(
            x=[v["step"] for v in named],
            y=[_scaled(w.get(field), scale) for w in at],
            text=[v.get("message", "") for v in named],
            hoverinfo="text",
            name="straggler named",
            mode="markers",
            marker={"symbol": "x", "size": 14, "color": "red"},
        )
    return fig


def _scaled(value, scale: float):
    return None if value is None else value * scale


def _window_at(windows: list[dict], step: int) -> dict:
    return next((w for w in windows if w["step"] >= step), windows[-1])


def phase_figure(rows: RunRows, recent: int | None = None):
    """Stacked bars: each rank's ms per step in each phase, over its last `recent` windows (None: all)."""
    import plotly.graph_objects as go

    span = "the whole run" if recent is None else f"the last {recent} log windows"
    fig = go.Figure(layout=_layout(f"where each rank's step goes ({span})", "", "ms per step", barmode="stack"))
    ranks = sorted(rows.ranks)
    names = [rank_name(rows.ranks[r]) for r in ranks]
    for phase, field in PHASE_TRACES:
        fig.add_bar(
            x=names, y=[_mean(rows.ranks[r][-recent:] if recent else rows.ranks[r], field) for r in ranks], name=phase
        )
    return fig


def _mean(windows: list[dict], field: str) -> float:
    """Milliseconds per step over `windows`, each weighted by its steps."""
    steps = sum(w.get("steps") or 1 for w in windows)
    return sum(w[field] * (w.get("steps") or 1) for w in windows) / steps * 1e3


def groups_figure(rows: RunRows):
    import plotly.graph_objects as go

    fig = go.Figure(layout=_layout("replica groups in the quorum", "step", "groups", yaxis={"dtick": 1}))
    if not rows.groups:
        fig.add_annotation(
            text="no replica groups in this run", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper"
        )
        fig.update_layout(xaxis={"visible": False}, yaxis={"visible": False})
        return fig
    fig.add_scatter(
        x=[step for step, _ in rows.groups],
        y=[n for _, n in rows.groups],
        name="groups",
        mode="lines+markers",
        line={"shape": "hv"},
    )
    return fig


def figures(rows: RunRows, recent: int | None = None) -> dict:
    """Every chart of the page, by the id of its place on the page."""
    drawn = {chart: line_figure(rows, field, title) for chart, (field, title) in record.charts().items()}
    drawn |= {"phases": phase_figure(rows, recent), "groups": groups_figure(rows)}
    return {name: drawn[name] for name in CHARTS}


def status(rows: RunRows) -> str:
    hosts = {w[-1]["host"] for w in rows.ranks.values()}
    if not rows.ranks:
        return "waiting for the first log window"
    named = sum(1 for v in rows.verdicts if v.get("phase") != "membership")
    return (
        f"{len(rows.ranks)} ranks on {len(hosts)} host{'s' * (len(hosts) != 1)}, step {rows.last_step};"
        f" {named} straggler verdict{'s' * (named != 1)}"
    )


def payload(rows: RunRows, recent: int | None = None) -> str:
    """What the page draws, as JSON: {"figures": {id: plotly figure}, "verdicts": [line], "status": line}."""
    drawn = {name: json.loads(fig.to_json()) for name, fig in figures(rows, recent).items()}
    lines = [v.get("message") or f"{v.get('phase')} at step {v.get('step')}" for v in rows.verdicts]
    return json.dumps({"figures": drawn, "verdicts": lines, "status": status(rows)})
