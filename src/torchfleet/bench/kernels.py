"""Where a GPU step's time goes: a few steps under torch.profiler, the kernels' time by kind.

Asked for with TORCHFLEET_BENCH_PROFILE=DIR (what `make gpu-check` sets): after
a cell's timed steps, its ranks run PROFILED_STEPS more under the profiler and
the main one writes DIR/<model>-<preset>-b<batch>-<precision>-<compile>-<strategy>x<n>.json:
the steps' wall time, the kernels' time summed by kind (KINDS: layout
conversions, attention, convolutions, matrix products, normalisation, the
optimizer's, and the rest: activations, casts, copies),
and the share of the wall time with no kernel counted at all (the GPU waiting
for the host: Python, dispatch, launches). That is the decomposition an MFU
below the target needs. The profiler adds its own cost; the shares are of
the profiled steps, whose wall time is given beside the timed median.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

ENV = "TORCHFLEET_BENCH_PROFILE"
PROFILED_STEPS = 3

# First match wins; names are lower-cased kernel names. Convolutions before matrix products: cuDNN's
# implicit-GEMM convolutions carry "xmma" and "gemm" in their names too. cuDNN's layout conversions
# (NCHW to NHWC and back) are their own kind: a channels-first model pays them around every convolution.
KINDS = (
    ("layout", ("nchwtonhwc", "nhwctonchw")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("convolution", ("fprop", "dgrad", "wgrad", "implicit_convolve", "winograd", "conv2d", "convolution")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "wgmma", "cublas")),
    # cuDNN's own batch norm (bn_fw_*, bn_bw_*): what torch picks in fp16, where bf16 gets torch's batch_norm_*.
    ("normalization", ("batch_norm", "layer_norm", "group_norm", "bn_fw_", "bn_bw_")),
    ("optimizer", ("multi_tensor", "foreach", "fused_sgd", "fused_adam")),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, parts in KINDS if any(p in name for p in parts)), "other")


def _device_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_steps(step: Callable[[], None], device: torch.device, name: str, write: bool = True) -> None:
    """Profile `step` PROFILED_STEPS times on `device` and write the summary (if `write`), where ENV names a
    folder; every rank of a cell calls it, so that their collectives meet."""
    folder = os.environ.get(ENV)
    if not folder or device.type != "cuda":
        return
    path = Path(folder) / f"{name}.json"
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(PROFILED_STEPS):
                step()
            torch.cuda.synchronize(device)
            wall_us = (time.perf_counter() - start) * 1e6
        kinds: dict[str, float] = {}
        top: dict[str, float] = {}
        for event in prof.key_averages():
            if str(getattr(event, "device_type", "")).endswith("CUDA"):
                us, kind = _device_us(event), kind_of(event.key)
                kinds[kind] = kinds.get(kind, 0.0) + us
                top[event.key] = top.get(event.key, 0.0) + us
        busy = sum(kinds.values())
        summary = {
            "steps": PROFILED_STEPS,
            "wall_ms_per_step": wall_us / PROFILED_STEPS / 1e3,
            "kernel_ms_per_step": {k: v / PROFILED_STEPS / 1e3 for k, v in sorted(kinds.items())},
            "share_of_wall": {k: v / wall_us for k, v in sorted(kinds.items())},
            "no_kernel_share": max(0.0, 1 - busy / wall_us),
            "top_kernels_ms_per_step": {
                k[:120]: v / PROFILED_STEPS / 1e3 for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]
            },
        }
    except Exception as exc:  # noqa: BLE001 (a diagnostic: its failure is written down, the cell's figures stand)
        summary = {"error": f"{type(exc).__name__}: {exc}"}
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
