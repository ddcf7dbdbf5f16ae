"""How many processes a `torchfleet train` gets, and which strategy "auto" means."""

from __future__ import annotations

import os

from torchfleet.errors import UsageError
from torchfleet.strategies import get_strategy, registry


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use, not the whole host
    except AttributeError:
        return os.cpu_count() or 1


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_processes(strategy: str, nproc: int | None) -> tuple[str, int, str]:
    """(strategy, processes per node, a sentence saying why, or "" when nothing was chosen)."""
    if nproc is not None and nproc < 1:
        raise UsageError(f"--nproc-per-node {nproc} must be at least 1")
    gpus, cores = _gpus(), _cpu_cores()
    if strategy == "auto":
        if nproc is not None:
            return registry.auto(nproc), nproc, ""
        one, several = registry.auto(1), registry.auto(2)
        if gpus >= 2:
            return several, gpus, f"strategy auto: {several} on {gpus} processes, one per GPU"
        if gpus == 1:
            # Two processes on one GPU would take turns on it and all-reduce through the host
            # (Gloo): one process, with a bigger batch or bf16, is what makes one GPU faster.
            return one, 1, f"strategy auto: {one} on the one GPU (processes sharing it would take turns)"
        if cores >= 2:
            return several, 2, f"strategy auto: {several} on 2 processes ({cores} CPU cores, no GPU)"
        return one, 1, f"strategy auto: {one} (one CPU core: more processes would only compete)"
    cls = get_strategy(strategy)
    preset = registry.presets()[strategy]
    if preset.launch == "spawn":
        # Not torchrun's processes: hogwild spawns its workers itself; -n counts them.
        if nproc is None:
            nproc = min(max(cores, 2), 8)
            return strategy, nproc, f"{strategy} on {nproc} workers (set -n to choose)"
        return strategy, nproc, ""
    if not cls.distributed:
        if nproc not in (None, 1):
            raise UsageError(
                f"strategy {strategy!r} runs in one process, not {nproc}; drop -n or use a"
                " multi-process strategy such as ddp"
            )
        return strategy, 1, ""
    if nproc is None:
        # Presets of two dimensions (hsdp, ddp+pipeline, fsdp+pipeline) need 2 x 2 to show both.
        need = max(2, preset.min_processes)
        nproc = gpus if gpus >= need else need
        return strategy, nproc, f"{strategy} on {nproc} processes (set -n to choose)"
    return strategy, nproc, ""
