"""Pipeline schedules: which torch class runs each, where its stages live, and what it accepts.

`--schedule` names one of torch.distributed.pipelining's schedules:

    gpipe             ScheduleGPipe                  one stage per process; all forwards, then all backwards
    1f1b              Schedule1F1B                   one stage per process; one forward, one backward
    interleaved-1f1b  ScheduleInterleaved1F1B        K stages per process, in a loop (Megatron's virtual stages)
    looped-bfs        ScheduleLoopedBFS              K stages per process, in a loop, breadth first
    interleaved-zb    ScheduleInterleavedZeroBubble  K stages per process, in a loop, weight gradients late
    zbv               ScheduleZBVZeroBubble          2 stages per process, in a V, weight gradients late

With `--stages-per-process K` the model is cut into pp x K stages. A loop puts
stage s on process s % pp (process 0 holds stages 0 and pp); a V puts
stages r and 2pp - 1 - r on process r, so the first and the last stage share
process 0 (torchtitan's `generate_stage_to_rank_mapping`, torch's too).

Every check here runs before any process starts (strategies.resolve_dims)
and again in each process: a schedule the installed torch lacks, a stage
count it cannot take, micro-batches it cannot split into rounds.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from torchfleet.errors import UsageError, choice_error
from torchfleet.versions import release

# name -> (torch's class name, stages per process it takes: 1, None for "2 or more", or exactly 2)
SCHEDULES: dict[str, tuple[str, int | None]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", None),
    "looped-bfs": ("ScheduleLoopedBFS", None),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", None),
    "zbv": ("ScheduleZBVZeroBubble", 2),
}
MULTI_STAGE = tuple(name for name, (_, per) in SCHEDULES.items() if per != 1)
# torch's interleaved schedules run micro-batches in rounds of max(1, m // pp) and refuse
# a count that is not a multiple of its rounds (ScheduleInterleaved1F1B.__init__).
ROUNDS = ("interleaved-1f1b", "interleaved-zb")


def _pipelining() -> ModuleType:
    """torch.distributed.pipelining, imported when a schedule is first looked up: the import takes about a
    second of CPU (Dynamo, DTensor), which every command line would pay, as bench's and plan's flags name
    schedules, though only a pipeline's processes run one."""
    return importlib.import_module("torch.distributed.pipelining")


# Schedules an older torch has but cannot run here, with the release that runs them. torch 2.11's
# multi-stage schedules open every stage's links with a send to the neighbouring stages' process,
# and in a V the two middle stages share one: a send to itself, which Gloo fails ("Pair is not
# connected"); 2.14 hands activations between a process's own stages without sending.
NEEDS_RELEASE: dict[str, tuple[int, int]] = {"zbv": (2, 14)}


def default_schedule(stages_per_process: int | None) -> str:
    """1f1b with one stage per process; interleaved 1F1B with several (torchtitan's choice too)."""
    # No schedule beat 1f1b where stages were timed (benchmarks/bubble.py): with large stages the others
    # were within noise, with small ones each extra stage boundary is a send that costs more than the bubble
    # it saves (docs/benchmarks/history.md, "Pipeline schedules and their bubbles").
    return "interleaved-1f1b" if (stages_per_process or 1) > 1 else "1f1b"


def schedule_class(name: str) -> type:
    """torch's class for schedule `name`; one sentence when the installed torch has none."""
    if name not in SCHEDULES:
        raise choice_error("schedule", name, tuple(SCHEDULES))
    found = getattr(_pipelining(), SCHEDULES[name][0], None)
    if found is None:
        raise UsageError(
            f"schedule {name} needs torch's {SCHEDULES[name][0]}, which torch"
            f" {torch.__version__.split('+')[0]} does not have; upgrade torch, or choose one of"
            f" {', '.join(available())}"
        )
    floor = NEEDS_RELEASE.get(name)
    if floor is not None and release() < floor:
        raise UsageError(
            f"schedule {name} needs torch {floor[0]}.{floor[1]} or later, and torch"
            f" {torch.__version__.split('+')[0]} sends between the two stages a process holds"
            f" in the V, which fails; upgrade torch, or use interleaved-zb or interleaved-1f1b"
        )
    return found


def available() -> list[str]:
    """The schedules the installed torch has and runs."""
    pipelining = _pipelining()
    return [
        n for n, (cls, _) in SCHEDULES.items() if hasattr(pipelining, cls) and release() >= NEEDS_RELEASE.get(n, (0, 0))
    ]


def microbatch_problem(name: str, pp: int, microbatches: int) -> str | None:
    """Why schedule `name` on `pp` processes cannot run `microbatches` micro-batches; None if it can."""
    if name == "1f1b" and microbatches < pp:
        return (
            f"schedule 1f1b needs at least as many micro-batches as stages: --microbatches {microbatches}"
            f" < {pp} stages; use gpipe or more micro-batches"
        )
    if name in ROUNDS:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (
                f"schedule {name} runs micro-batches in rounds of one per process, and --microbatches"
                f" {microbatches} on {pp} processes is not a whole number of rounds; use a multiple of {pp}"
            )
    return None


def check_schedule(
    name: str | None, pp: int, stages_per_process: int | None = None, microbatches: int | None = None
) -> tuple[str, int]:
    """(schedule, stages per process) once both are known to run together on `pp` processes."""
    per = 1 if stages_per_process is None else stages_per_process
    if not isinstance(per, int) or per < 1:
        raise UsageError(f"--stages-per-process {per!r} must be a whole number, at least 1")
    name = name or default_schedule(per)
    if name not in SCHEDULES:
        raise choice_error("schedule", name, tuple(SCHEDULES))
    takes = SCHEDULES[name][1]
    if takes == 1 and per > 1:
        raise UsageError(
            f"schedule {name} runs one stage per process and --stages-per-process is {per};"
            f" use {', '.join(MULTI_STAGE)}, or --stages-per-process 1"
        )
    if takes is None and per < 2:
        raise UsageError(
            f"schedule {name} runs several stages on each process; give --stages-per-process 2"
            " or more, or use 1f1b for one stage per process"
        )
    if takes == 2 and per != 2:
        raise UsageError(
            f"schedule {name} places exactly 2 stages on each process (a V) and"
            f" --stages-per-process is {per}; give --stages-per-process 2"
        )
    schedule_class(name)  # after the counts, so a count is refused in the same words on every torch
    if microbatches is not None:
        problem = microbatch_problem(name, pp, microbatches)
        if problem:
            raise UsageError(problem)
    return name, per


def schedule_variant(name: str) -> tuple[str, dict]:
    """bench's cell name "pipeline/zbv" as (strategy, options): the schedule, with 2 stages per process
    where it takes several (4 stages on 2 processes, the issue's set-up)."""
    strategy, _, schedule = name.partition("/")
    per = 1 if SCHEDULES.get(schedule, ("", 1))[1] == 1 else 2
    schedule, per = check_schedule(schedule, 2, per)
    return strategy, {"schedule": schedule, "stages_per_process": per}


def stage_ranks(name: str, pp: int, stages_per_process: int) -> list[int]:
    """The pipeline rank (0 .. pp-1) holding each of the pp x K stages."""
    total = pp * stages_per_process
    if name == "zbv":  # a V: down the processes, then back up
        return [s if s < pp else total - 1 - s for s in range(total)]
    return [s % pp for s in range(total)]


def local_stages(name: str, pp: int, stages_per_process: int, pp_rank: int) -> list[int]:
    """The stages process `pp_rank` of the pipeline holds, in increasing order."""
    return [s for s, r in enumerate(stage_ranks(name, pp, stages_per_process)) if r == pp_rank]


# The share of 1F1B's fill and drain a zero-bubble schedule leaves idle, when forward, input backward and
# weight backward take equal time (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): torch's interleaved
# zero bubble is the paper's ZB1P, which keeps 1F1B's memory and fills two thirds of it; ZB-V fills it all.
ZERO_BUBBLE_SHARE = {"interleaved-zb": 1 / 3, "zbv": 0.0}


def bubble_formula(name: str, pp: int, stages_per_process: int, microbatches: int) -> float:
    """The idle fraction each process's schedule has in theory, every stage taking equal time.

    GPipe and 1F1B: (p-1)/(m+p-1). Interleaved and looped: each of the p-1 steps of
    fill and drain is one of v stages' work, (p-1)/(v*m+p-1). Zero bubble fills the
    drain with weight gradients: a third of it left (interleaved-zb), or none (zbv).
    """
    p, v, m = pp, stages_per_process, microbatches
    if p <= 1:
        return 0.0
    fill = (p - 1) * ZERO_BUBBLE_SHARE.get(name, 1.0)
    return fill / (v * m + fill)


def build_schedule(name: str, stages: list, microbatches: int, loss_fn):
    """torch's schedule over this process's stages; scaling by micro-batch count is left to loss_fn."""
    cls = schedule_class(name)
    if SCHEDULES[name][1] == 1:
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
