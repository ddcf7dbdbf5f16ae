"""What a pipeline process holds at its peak, read from the order of actions torch's schedule runs.

torch.distributed.pipelining's schedules write out, for every process, the list of actions they run: a stage's
forward (F) of a micro-batch, its full backward (B), or under the zero-bubble schedules its input-gradient (I)
and weight-gradient (W) halves, and a stage's REDUCE_GRAD where the schedule lists one. The plan builds the
schedule itself on a fake process group of pp ranks, with one-weight stages standing where the model's are, and
walks a process's list with two accounts:

    activations  an F adds a micro-batch's worth of that stage's activations; a B frees them; under zero
                 bubble a W frees them, since the weight gradient needs the layer inputs the forward saved
    gradients    a stage's first backward creates its unsharded fp32 gradients (FSDP accumulates them there
                 over the micro-batches), and its last backward's reduce-scatter (or its REDUCE_GRAD) frees them

so the peak is where the two together are highest. A stage is 1/v of a process's blocks; an interleaved
process's peak comes where its warm-up's forwards meet its first stage's gradients only, and 1F1B's where its
first process's p forwards meet the whole stage's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from torchfleet.strategies.pipeline import schedules


@dataclass(frozen=True)
class Peak:
    """A process's peak, in its own units: micro-batches of the whole process's blocks, and the fraction of its
    unsharded gradients alive then."""

    microbatches: float
    gradients: float


@lru_cache(maxsize=64)
def orders(schedule: str, pp: int, microbatches: int, v: int) -> dict[int, tuple[tuple[str, int, int], ...]]:
    """Every process's actions as (kind, stage, micro-batch), as torch's class for `schedule` orders them."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plan orders a pipeline on a fake process group of its own: call it outside a job")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        ids = schedules.local_stages(schedule, pp, v, 0)
        stages = [PipelineStage(nn.Linear(1, 1), s, pp * v, torch.device("cpu")) for s in ids]
        made = schedules.build_schedule(schedule, stages, microbatches, lambda out, target: out.sum())
        order = made.pipeline_order
    finally:
        dist.destroy_process_group()
    return {
        rank: tuple(
            (str(a.computation_type.value), a.stage_index, a.microbatch_index or 0) for a in actions if a is not None
        )
        for rank, actions in order.items()
    }


def peak(schedule: str, pp: int, microbatches: int, v: int, rank: int, activation: float, gradient: float) -> Peak:
    """Process `rank`'s peak, given `activation`, the bytes one micro-batch through its blocks leaves for the
    backward, and `gradient`, its blocks' unsharded fp32 gradients."""
    actions = orders(schedule, pp, microbatches, v)[rank]
    reduced = {stage for kind, stage, _ in actions if kind == "REDUCE_GRAD"}
    grad_kind = "W" if any(kind == "W" for kind, _, _ in actions) else "B"
    last = {stage: i for i, (kind, stage, _) in enumerate(actions) if kind == grad_kind}
    held = grads = 0  # in stages' (1/v of the process's blocks) micro-batches, and stages' gradients
    best, at = -1.0, Peak(0.0, 0.0)
    seen: set[int] = set()
    for i, (kind, stage, _) in enumerate(actions):
        if kind == "F":
            held += 1
        if kind == grad_kind and stage not in seen:  # gradients made while the micro-batch's activations live
            seen.add(stage)
            grads += 1
        bytes_now = (held * activation + grads * gradient) / v
        if bytes_now > best:
            best, at = bytes_now, Peak(held / v, grads / v)
        if kind in ("B", "W"):
            held -= 1
        if (kind == grad_kind and last[stage] == i and stage not in reduced) or kind == "REDUCE_GRAD":
            grads -= 1
    return at
