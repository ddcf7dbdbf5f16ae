"""fp32, bf16 and fp16 training: autocast for the forward, a scaler for fp16.

bf16 has fp32's exponent range, so it needs no loss scaling and runs under
CPU autocast too. fp16 needs a GradScaler against underflowing gradients and
is only offered on CUDA, where it pays.
"""

from __future__ import annotations

import contextlib

import torch

from torchfleet.errors import UsageError, choice_error

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Where fp16 is offered. torch's GradScaler and fp16 autocast also run on the
# CPU (slowly: few CPUs compute in fp16), so the test suite adds "cpu" here to
# exercise the scaler's skip-and-sync logic on machines without a GPU.
FP16_DEVICES = ("cuda",)


class Precision:
    def __init__(self, name: str, device: torch.device):
        if name not in PRECISIONS:
            raise choice_error("precision", name, PRECISIONS)
        if name == "fp16" and device.type not in FP16_DEVICES:
            raise UsageError(
                f"precision fp16 needs a CUDA device and this run is on {device.type}; use bf16 (or fp32) on CPU"
            )
        self.name = name
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def sync_overflow(self, group) -> None:
        """fp16 where ranks hold different gradients (shards, pipeline stages).

        Each rank's scaler would otherwise find inf/NaN in its own gradients
        only and skip a step the others take; the sharded scaler all-reduces
        the finding over `group` so every rank skips the same steps.
        """
        if self.scaler is not None:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.type, process_group=group)

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.name])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: divide the gradients by the loss scale now (before clipping them), not in `step`."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # skips the step when gradients overflowed
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
