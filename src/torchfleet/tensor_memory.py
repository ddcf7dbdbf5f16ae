"""Peak bytes held by tensors, on any device: the CPU counterpart of `torch.cuda.max_memory_allocated`.

A process's resident set is a poor measure of what a strategy keeps. On CPU
it also counts the allocator's retained pages and Gloo's own buffers, and
under fsdp it grows step after step while the tensors held stay the same
(docs/benchmarks/history.md). A GPU reports instead the peak of the bytes handed to
tensors. The same figure on CPU comes from torch's `MemTracker`
(torch.distributed._tools, in every torch torchfleet supports), which sees
every tensor an op creates, every storage FSDP resizes, and every free, from
any thread.

The profiler's allocator records were tried first and are not used: c10
reports a free only on a thread that is being profiled, and FSDP's
reduce-scatter buffers are often freed on Gloo's worker threads, so the sum
drifted upward by tens of MiB a step.

Tracking runs Python code for every op: measure memory in steps that are not
timed. MemTracker refuses a model's second forward in one step, which a
pipeline's schedule makes (each stage runs once per micro-batch): there the
per-module records are cleared and the count goes on (`_Stages`), which keeps
the peak, the one figure read here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

_TOTAL = "Total"  # MemTracker's key for the sum over categories


class _Stages(MemTracker):
    """MemTracker that lets a module run forward again within a step, as a pipeline stage does per micro-batch."""

    def _pre_fw_hook(self, module, inputs) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # "multiple iterative calls": the stage's next micro-batch
            self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)


class TensorMemory:
    """Context manager: the peak bytes of tensors per device while it is open.

    `tracked` are the objects that exist before it opens and count from the
    start (a model, an optimizer, batches). Call `next_step()` before each
    training step: MemTracker's per-module records refuse a second forward
    of the same model, and clearing them leaves its peak as it was.

        with TensorMemory(model, optimizer) as memory:
            for batch in batches:
                memory.next_step()
                fleet.train_step(...)
        memory.peak_bytes("cpu")
    """

    def __init__(self, *tracked: Any) -> None:
        self._tracker = _Stages()
        if tracked:
            self._tracker.track_external(*tracked)
        self._peak: dict[torch.device, int] = {}

    def __enter__(self) -> TensorMemory:
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tracker.__exit__(*exc)
        self._peak = {device: figures[_TOTAL] for device, figures in self._tracker.get_tracker_snapshot("peak").items()}

    def next_step(self) -> None:
        self._tracker.reset_mod_stats()

    def peak_bytes(self, device: str | torch.device = "cpu") -> int:
        return self._peak.get(torch.device(device), 0)
