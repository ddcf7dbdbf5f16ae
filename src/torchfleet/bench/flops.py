"""Model FLOPs per sample, and the GPU peaks that turn them into MFU (model FLOPs utilisation).

MFU = model FLOPs per second achieved / the devices' peak, as in PaLM's
appendix B: the FLOPs a training step needs (forward and backward, counted
once), not those recomputation or padding add. They are counted by torch's
`FlopCounterMode` on a copy of the model whose tensors live on the meta
device: shapes only, so counting costs neither memory nor compute.

Peaks are dense (no structured sparsity) tensor-core figures from NVIDIA's
datasheets, in TFLOP/s per GPU. fp32 is measured against the TF32 peak: the
fastest path fp32 can take, and the one cuDNN's convolutions take by default
(matmuls stay in full fp32 unless `torch.backends.cuda.matmul.allow_tf32`).
"""

from __future__ import annotations

import copy
import itertools
from typing import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# (substring of torch.cuda.get_device_name, {precision: dense TFLOP/s}), first match wins.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4}),  # H200 SXM datasheet
    ("H100 NVL", {}),  # not listed here: no MFU rather than another card's peak
    ("H100 PCIe", {"fp32": 378.0, "bf16": 756.0, "fp16": 756.0}),  # H100 PCIe datasheet
    ("H100", {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4}),  # H100 SXM5 datasheet
    ("A100", {"fp32": 156.0, "bf16": 312.0, "fp16": 312.0}),  # A100 datasheet
    ("V100", {"fp32": 15.7, "fp16": 125.0}),  # V100 SXM2 datasheet: no TF32, no bf16
)


def peak_flops(device_name: str | None, precision: str) -> float | None:
    """One GPU's dense peak in FLOP/s for `precision`, or None where unknown (any CPU)."""
    for part, peaks in PEAK_TFLOPS:
        if device_name and part in device_name:
            tflops = peaks.get(precision)
            return tflops * 1e12 if tflops is not None else None
    return None


def _meta_copy(model: nn.Module) -> nn.Module:
    """The model with every parameter and buffer on the meta device, its data never copied."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _meta(batch):
    if isinstance(batch, dict):
        return {k: _meta(v) for k, v in batch.items()}
    return batch[:2].to("meta") if isinstance(batch, torch.Tensor) else batch


def flops_per_sample(model: nn.Module, inputs, targets: torch.Tensor, loss_fn: Callable) -> float | None:
    """FLOPs of one forward and backward per sample, or None when the model cannot run on meta tensors.

    (A forward that reads a value from a tensor, e.g. to branch on it, cannot.)
    """
    try:
        meta_model, x, y = _meta_copy(model), _meta(inputs), _meta(targets)
        samples = len(y)
        with FlopCounterMode(display=False) as counter:
            output = meta_model(**x) if isinstance(x, dict) else meta_model(x)
            loss_fn(output, y).backward()
        return counter.get_total_flops() / samples
    except Exception:  # noqa: BLE001 (a best-effort figure: the row says "-" instead)
        return None
