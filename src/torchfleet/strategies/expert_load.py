"""How many tokens each expert got: the first thing a mixture-of-experts run is looked at for.

Every module holding experts (strategies/expert_parallel.py's `find_experts`) is called with each
token's chosen experts; a hook counts them there, under every strategy, before expert parallelism
sends any token away. The counts stay on each rank (no collective per step) until `shares`, which
sums them over every rank once, at the end, over every layer: each expert's share of the routed
tokens. Ranks that see the same tokens (a tensor-parallel group, a recomputed forward) count them
alike, which leaves the shares as they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from torchfleet.strategies.expert_parallel import find_experts


class ExpertLoad:
    def __init__(self, model: nn.Module | list[nn.Module]):
        self.counts: torch.Tensor | None = None
        self.taken = False  # whether someone asked for the shares (then `say_once` says nothing)
        for module in _experts(model):
            module.register_forward_pre_hook(self._count)

    @classmethod
    def attach(cls, model: nn.Module | list[nn.Module]) -> ExpertLoad | None:
        """A counter on the experts of `model` (or of mp's stages given as a list), before any strategy sends their
        tokens away; None without experts."""
        return cls(model) if _experts(model) else None

    def _count(self, _module: nn.Module, args: tuple) -> None:
        chosen = args[1].detach().reshape(-1)  # (hidden_states, top_k_index, top_k_weights)
        if chosen.is_meta or is_fake(chosen):  # a shape-only run (plan's trace, a meta model's cut) routes nothing
            return
        experts = next(_module.parameters(recurse=False)).shape[0]  # a DTensor's shape is the whole's
        counted = torch.bincount(chosen, minlength=experts)
        self.counts = counted if self.counts is None else self.counts + counted

    def shares(self, device: torch.device) -> list[float] | None:
        """Each expert's share of the tokens routed, over every rank and layer; None for a model without experts.
        A collective where a process group is up: every rank calls it (`device`: where its backend reduces)."""
        self.taken = True
        counts = (self.counts if self.counts is not None else torch.zeros(0, dtype=torch.long)).to(device)
        if is_fake(counts):  # made under plan's fake tensors: nothing was counted
            return None
        if dist.is_initialized():  # a rank holding no experts (another pipeline stage's) adds zeros
            size = torch.tensor([counts.numel()], device=device)
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
            padding = torch.zeros(int(size) - counts.numel(), dtype=torch.long, device=device)
            counts = torch.cat([counts, padding])
            dist.all_reduce(counts)
        total = int(counts.sum())
        return [int(c) / total for c in counts] if total else None

    def say_once(self, say, device: torch.device) -> None:
        """At the end of a run on every rank (a collective): `say` the line of `summary`, unless the shares
        were asked for already (the built-in job puts them in its own summary)."""
        if not self.taken and (shares := self.shares(device)):
            say(f"torchfleet: tokens per expert: {summary(shares)}")


def summary(shares: list[float]) -> str:
    """'e0 27.1%, e1 24.0%, e2 26.2%, e3 22.7%; busiest 1.08x the mean' (the extremes only past 16 experts)."""
    mean = 1 / len(shares)
    busiest = max(range(len(shares)), key=shares.__getitem__)
    idlest = min(range(len(shares)), key=shares.__getitem__)
    ratio = f"busiest {shares[busiest] / mean:.2f}x the mean"
    if len(shares) <= 16:
        return ", ".join(f"e{i} {s:.1%}" for i, s in enumerate(shares)) + f"; {ratio}"
    return f"{len(shares)} experts; e{busiest} {shares[busiest]:.1%} ({ratio}), e{idlest} {shares[idlest]:.1%}"


def _experts(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The modules holding experts in `model`, or in each stage of a list of stages."""
    stages = model if isinstance(model, (list, tuple)) else [model]
    return [m for stage in stages if isinstance(stage, nn.Module) for _, m in find_experts(stage)]
