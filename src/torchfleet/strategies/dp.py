"""dp: one process, `nn.DataParallel` over every visible GPU.

Each forward scatters the batch along its first dimension into one chunk per
GPU, runs a replica of the model on each chunk in its own thread, and gathers
the outputs on the first GPU; the loss and the backward see the whole batch,
so the update is serial's. With fewer than two GPUs there is nothing to split:
the model is still wrapped (user code sees the same type everywhere) and runs
on the one device, and a note says so once.
"""

from __future__ import annotations

import torch
from torch import nn

from torchfleet.strategies.base import Strategy


def scatter_sizes(batch: int, devices: int) -> list[int]:
    """The chunk sizes DataParallel's scatter cuts a batch of `batch` into over `devices` GPUs.

    Scatter (torch/csrc/cuda/comm.cpp) cuts with ``tensor.chunk(len(devices))``:
    chunks of ceil(batch / devices), the last one smaller, and fewer chunks than
    devices when the batch is small (DataParallel then replicates onto fewer GPUs).
    """
    return [len(c) for c in torch.empty(batch).chunk(max(1, devices))]


class DataParallelSingleProcess(Strategy):
    model: nn.DataParallel  # what wrap makes; unwrapped() reads its .module

    def __init__(self, runtime, options=None):
        super().__init__(runtime, options)
        gpus = torch.cuda.device_count() if runtime.device.type == "cuda" else 0
        # Fleet put this one process on cuda:0, which DataParallel wants as device_ids[0].
        self.device_ids = list(range(gpus))
        if gpus < 2:
            self.notes.append(
                f"dp splits each batch across GPUs and {gpus} {'is' if gpus == 1 else 'are'} visible,"
                f" so nn.DataParallel has nothing to split; running on {runtime.device} alone"
            )

    def wrap(self, model, optimizer, args):
        model = model.to(self.runtime.device)
        # No device ids (CPU): DataParallel's forward calls the module directly.
        self.model = nn.DataParallel(model, device_ids=self.device_ids or None)
        self.optimizer = optimizer
        return self.model, self.optimizer

    def unwrapped(self):
        return self.model.module

    def chunk_sizes(self, batch: int) -> list[int]:
        """What each GPU gets of a batch of `batch` samples (one chunk on fewer than 2 GPUs)."""
        return scatter_sizes(batch, len(self.device_ids))
