"""A model whose tensor-parallel plan is wrong by construction, for `torchfleet verify` to catch.

Each block normalises its hidden units (fc1's output) to unit length before fc2. The plan splits fc1 by
columns and fc2 by rows, as Megatron splits an MLP, but under that split each rank normalises its half of
the hidden units alone: every shape still fits, nothing raises, and tp computes another function than
serial. ddp, fsdp and pipeline keep every layer whole and train it as serial does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        hidden = self.fc1(x)
        return x + self.fc2(torch.relu(hidden / hidden.norm(dim=-1, keepdim=True)))


class NormalisedMLPs(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.embed(x.flatten(1))
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def tp_plan(self) -> dict:
        return {
            **{f"blocks.{i}.fc1": ColwiseParallel() for i in range(len(self.blocks))},
            **{f"blocks.{i}.fc2": RowwiseParallel() for i in range(len(self.blocks))},
        }


def build() -> nn.Module:
    return NormalisedMLPs()
