"""A pipeline stage that times its compute, and helpers for cutting and feeding stages."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from torchfleet.strategies.cutting import tied_groups


class TimedStage(PipelineStage):
    """A PipelineStage that times its compute.

    The schedules wait for received activations before calling these two
    methods and send asynchronously after, so the time inside them is the
    stage's busy time; the rest of a schedule step is idle (the bubble).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = 0.0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # device time, not launch time

    def _timed(self, run, *args, **kwargs):
        self._sync()
        tick = time.perf_counter()
        out = run(*args, **kwargs)
        self._sync()
        self.busy += time.perf_counter() - tick
        return out

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)


def rows(batch, start: int, size: int):
    """Rows [start, start + size) of `batch`, the last row repeated where the batch ends first."""
    def take(t: torch.Tensor) -> torch.Tensor:
        part = t[start:start + size]
        if len(part) < size:
            part = torch.cat([part, part[-1:].expand(size - len(part), *part.shape[1:])])
        return part
    return {k: take(v) for k, v in batch.items()} if isinstance(batch, dict) else take(batch)


def sequential_ties(model: nn.Module, bounds) -> list[tuple[list[str], list[int]]]:
    """Tied parameters of a Sequential cut by children, with the stages holding them."""
    children = [name for name, _ in model.named_children()]
    out = []
    for names in tied_groups(model):
        holders = sorted({s for s, (a, b) in enumerate(bounds) for n in names
                          if n.split(".", 1)[0] in children[a:b]})
        if len(holders) > 1:
            out.append((names, holders))
    return out
