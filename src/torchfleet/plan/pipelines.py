"""The pipeline schedules as the plan models them: the idle fraction of a step and the activations held.

p processes, m micro-batches, v stages per process (--stages-per-process; the
model cut into p x v stages), every stage taking equal time. A "slot" is one
stage's forward and backward of one micro-batch, 1/(p v) of a micro-batch's
work through the whole model.

Bubble, the idle fraction of each process's step:
    gpipe, 1f1b                (p-1) / (m + p-1)           fill and drain: p-1 slots of a whole stage
    interleaved-1f1b, looped-bfs  (p-1) / (v m + p-1)      the same p-1 slots, each 1/v as long
                               (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
                               Clusters Using Megatron-LM", 2021, section 2.2)
    interleaved-zb             (p-1) / (3 v m + p-1)       ZB-H1 (torch's ScheduleInterleavedZeroBubble
                               implements the paper's ZB1P): deferring the weight gradients W fills the
                               drain, leaving (p-1)(T_F + T_B - T_W) of the 1F1B bubble's (p-1)(T_F + T_B + T_W);
                               with T_F = T_B = T_W (the paper's own assumption) a third of it, in slots 1/v as long
    zbv                        0                           ZB-V, the paper's section 6: zero when T_F = T_B = T_W
    (Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism", 2023, arXiv:2401.10241.) On a CPU the
    three parts are not equal, so these two are lower bounds; the plan says so where it shows them.

Activations a process holds at its peak, in micro-batches' worth of the whole model's activations
(a micro-batch through all p v stages is 1):
    gpipe, looped-bfs          m / p             every forward on a stage before its first backward
    1f1b, zbv                  min(m, p) / p     stage 0 holds p micro-batches in flight; ZB-V keeps
                                                  1F1B's peak (the zero bubble paper's section 6)
    interleaved-1f1b, interleaved-zb   min(m, p) / p x (1 + (p-1)/(p v))   the interleaved warm-up holds
                               more (Korthikanti et al., "Reducing Activation Recomputation in Large
                               Transformer Models", 2022); ZB1P keeps its loop's warm-up
"""

from __future__ import annotations

from torchfleet.strategies.pipeline.schedules import MULTI_STAGE, SCHEDULES, ZERO_BUBBLE_SHARE, bubble_formula


def held_by_last(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches' worth of its own activations the last process holds at its peak, against the first's
    p x activations_held: every forward under gpipe and looped-bfs (m); one under 1f1b, which runs a
    micro-batch's backward right after its forward there; under the interleaved schedules its warm-up,
    (v - 1) p chunks of 1/v of its layers, and the one in flight (the first process's warm-up has 2 (p - 1)
    more, which gives activations_held's (p v + p - 1) / v)."""
    if schedule in ("gpipe", "looped-bfs"):
        return m
    if schedule in ("interleaved-1f1b", "interleaved-zb"):
        return min(m, ((v - 1) * p + 1) / v)
    return 1.0


def stages_per_process(schedule: str, requested: int | None) -> int:
    """The v a schedule runs with: 1 for gpipe and 1f1b, 2 for zbv, the request (default 2) for the loops."""
    takes = SCHEDULES[schedule][1]
    if takes is not None:
        return takes
    return requested or 2


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle fraction of a step under `schedule` (the module's table; the pipeline reports the same)."""
    return bubble_formula(schedule, p, v if schedule in MULTI_STAGE else 1, m)


def bubble_slots(schedule: str, p: int, m: int, v: int = 1) -> tuple[int, float]:
    """(busy slots, idle slots) of a process's step: v m slots of work and the fill and drain between."""
    per = v if schedule in MULTI_STAGE else 1
    idle = (p - 1) * ZERO_BUBBLE_SHARE.get(schedule, 1.0) if p > 1 else 0.0
    return per * m, idle


def activations_held(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches' worth of the whole model's activations one process holds at its peak."""
    if schedule in ("gpipe", "looped-bfs"):
        return m / p
    held = min(m, p) / p
    if schedule in ("interleaved-1f1b", "interleaved-zb"):
        held *= 1 + (p - 1) / (p * v)
    return held
