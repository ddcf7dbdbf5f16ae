"""The pipeline report: the stages' layout, and each process's measured idle fraction next to the schedule's formula.

Each process times its stages' compute (stages.py: `TimedStage`) and the
schedule's steps after the first; the idle fraction of a pipeline process is
1 - busy / wall over its stages together, the bubble the schedule's formula
predicts (schedules.py: `bubble_formula`, (p-1)/(m+p-1) for GPipe and 1F1B).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from torchfleet.strategies.pipeline import cutting, schedules


def layers_per_stage(bounds: Sequence[tuple[int, int]] | None, cut: cutting.Cut | None) -> list[str]:
    """Each stage's layers: a Sequential's children by index, a cut model's from the module each stage starts at."""
    return (
        [f"{a}-{b - 1}" for a, b in bounds]
        if bounds
        else [f"{name}.." for name in ("input", *cut.starts)]
        if cut
        else []
    )


def pipeline_report(
    schedule: str,
    pp: int,
    per_process: int,
    replicas: int,
    microbatches: int,
    layers: list[str],
    pp_rank: int,
    busy_wall: Sequence[float],
) -> dict:
    """The report of every process (a collective: every rank calls it), from this one's pipeline rank and
    (stage busy seconds, schedule seconds)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (pp_rank, *busy_wall))
    idle = []
    for rank in range(pp):
        busy = sum(b for r, b, _ in every if r == rank)
        wall = sum(w for r, _, w in every if r == rank)
        idle.append(round(1 - busy / wall, 3) if wall else float("nan"))
    p, m = pp, microbatches
    return {
        "schedule": schedule,
        "stages": pp * per_process,
        "stages_per_process": per_process,
        "processes": p,
        "replicas": replicas,
        "microbatches": m,
        "layers_per_stage": layers,
        "bubble_formula": round(schedules.bubble_formula(schedule, p, per_process, m), 3),
        "bubble_measured": idle,
    }
