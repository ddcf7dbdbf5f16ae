"""Channels-last (NHWC) for convolution models where a GPU's kernels want it.

cuDNN's tensor-core convolutions in bf16 and fp16 work on NHWC. A model left
channels-first (NCHW, torch's default) pays a layout conversion around every
convolution, and in bf16 torch's own batch-norm kernels instead of the
channels-last ones: on a GPU that was most of resnet50's bf16 step outside
convolutions and matrix products (docs/benchmarks). So a model with
convolutions, trained in bf16 or fp16 on a GPU, is made channels-last by
default, with its image batches; fp32 and the CPU keep torch's default, since
their kernels gain little from it and the CPU's give different float sums.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NOTE = "channels_last: the model's convolution weights and its 4-D inputs are NHWC (cuDNN's layout in {precision})"


def has_convolutions(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def wants_channels_last(asked: bool | None, model: nn.Module, precision: str, device: torch.device) -> bool:
    """`asked` when given (True or False); None: on for a convolution model in bf16 or fp16 on a GPU."""
    if asked is not None:
        return asked and has_convolutions(model)
    return device.type == "cuda" and precision in ("bf16", "fp16") and has_convolutions(model)


def apply(asked: bool | None, model: nn.Module, precision: str, device: torch.device, notes: list[str]) -> bool:
    """Make `model` channels-last in place where `wants_channels_last` says so (its parameters stay the same
    objects, so an optimizer built over them still holds them), adding NOTE to `notes`; whether it did."""
    if not wants_channels_last(asked, model, precision, device):
        return False
    model.to(memory_format=torch.channels_last)
    notes.append(NOTE.format(precision=precision))
    return True


def to_channels_last(value: Any) -> Any:
    """A 4-D floating tensor in NHWC memory (same shape and values); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
        return value.contiguous(memory_format=torch.channels_last)
    return value
