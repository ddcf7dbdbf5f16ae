"""A pipeline's gradients across processes: tied copies summed, and clipped to the whole model's norm.

A tied parameter (GPT-2's embedding and head) has a copy on each stage that
uses it (cutting.py: `tied_groups`); summing the copies' gradients over the
processes holding them gives every copy the one parameter's gradient, so all
take the same update. Clipping measures the norm of the whole model, every
stage and shard, counting each tied parameter once, as serial clips.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchfleet.strategies.dims import ParallelDims


def tied_process_groups(
    tied: Sequence[tuple[list[str], list[int]]], dims: ParallelDims, stage_rank: Sequence[int], rank: int
) -> list:
    """For each tied parameter: the group of this replica's processes holding a copy of it (None: none here,
    or all copies on this process, one Parameter already: share_tensors).

    Every rank makes every group, in the same order (torch requires it).
    """
    place = {(dims.dp_rank(r), dims.coords(r)["pp"]): r for r in range(dims.world_size)}
    mine_dp, mine_pp = dims.dp_rank(rank), dims.coords(rank)["pp"]
    mine = []
    for _, holders in tied:
        ranks = sorted({stage_rank[stage] for stage in holders})
        chosen = None
        for dp_rank in range(dims.dp if len(ranks) > 1 else 0):
            group = dist.new_group([place[(dp_rank, pp_rank)] for pp_rank in ranks])
            if dp_rank == mine_dp and mine_pp in ranks:
                chosen = group
        mine.append(chosen)
    return mine


def sync_tied_gradients(model: nn.Module, tied: Sequence[tuple[list[str], list[int]]], groups: list) -> None:
    """Sum a tied parameter's gradient over the processes holding copies: the one parameter's gradient."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for (names, _), group in zip(tied, groups, strict=True):
        if group is None:
            continue
        param = next(params[n] for n in names if n in params)
        if not param.requires_grad:  # frozen (a fine-tuned model's tied embedding): nothing to sum
            continue
        if param.grad is None:  # this process's copy took no part in the step: it adds nothing
            param.grad = torch.zeros_like(param)
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        dist.all_reduce(grad, group=group)


def clip_to_global_norm(
    model: nn.Module,
    tied: Sequence[tuple[list[str], list[int]]],
    stage_rank: Sequence[int],
    pp_rank: int,
    replicas: int,
    max_norm: float,
    device: torch.device,
) -> torch.Tensor:
    """Clip to the global norm of the whole model: every stage's and every shard's gradients; returns the norm.

    Each rank adds the squares of the gradient it holds; the sum over all
    ranks counts each replica once per replica (divided out) and a tied
    parameter once per stage holding it (only its first holder counts).
    """
    params = dict(model.named_parameters())
    skip = {
        id(params[n]) for (names, holders) in tied if stage_rank[holders[0]] != pp_rank for n in names if n in params
    }
    held = [(p, p.grad) for p in params.values() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for _, g in held]
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (p, _), g in zip(held, local, strict=True):
        if id(p) not in skip:  # counted once, scaled on every stage below
            total += g.detach().float().pow(2).sum()
    dist.all_reduce(total)
    norm = (total / replicas).sqrt()
    # torch's clip_grad_norm_ formula, so a pipeline clips as serial does.
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in local:
        g.mul_(coef.to(g.dtype))
    return norm
