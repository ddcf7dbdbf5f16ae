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
timed. MemTracker also follows modules (ModTracker's hooks) for its
per-module records, which this figure never reads, and those hooks fail where
a pipeline runs: a stage's second forward in a step is refused ("multiple
iterative calls"), and the zero-bubble schedules' split backward
(autograd.grad) trips ModTracker's gradient hooks ("A leaf node was passed to
_will_engine_execute_node"). So modules are not followed here (`_TensorsOnly`):
every tensor is still counted as its operator makes it, in the same total.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

_TOTAL = "Total"  # MemTracker's key for the sum over categories


class _NoModules:
    """What MemTracker asks of its module tracker, answered for no module: no hooks, never in a backward."""

    parents: frozenset[str] = frozenset()
    is_bw = False

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _TensorsOnly(MemTracker):
    """MemTracker counting tensors without following modules (the module's docstring says why)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModules()  # pyright: ignore[reportAttributeAccessIssue]


class TensorMemory:
    """Context manager: the peak bytes of tensors per device while it is open.

    `tracked` (a model, an optimizer, a batch or a dict of them) count from
    the start. `whole_process=True` counts every tensor alive when it is made,
    as a GPU's allocator counts what it has handed out: a rank of a job holds
    its model, its optimizer's state, its batch and what its strategy keeps
    between steps (a pipeline schedule's receive buffers, which MemTracker
    would otherwise never see). Under a fake mode (plan's traces) that mode's
    own tensors are all of the step there is, and count always; the
    planner's real ones never do.

        with TensorMemory(model, optimizer) as memory:
            for _ in range(steps):
                fleet.train_step(inputs, targets, loss_fn)
        memory.peak_bytes("cpu")
    """

    def __init__(self, *tracked: Any, whole_process: bool = False) -> None:
        self._tracker = _TensorsOnly()
        self._tracker.track_external(*tracked, *_live_tensors(whole_process))
        self._peak: dict[torch.device, int] = {}

    def __enter__(self) -> TensorMemory:
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tracker.__exit__(*exc)
        self._peak = {device: figures[_TOTAL] for device, figures in self._tracker.get_tracker_snapshot("peak").items()}

    def peak_bytes(self, device: str | torch.device = "cpu") -> int:
        return self._peak.get(torch.device(device), 0)


def _live_tensors(whole_process: bool) -> list[torch.Tensor]:
    """The tensors alive now that count from the start: under a fake mode that mode's fake tensors alone; else the
    process's real ones where it is a rank of the job (`whole_process`), none where other work shares it (a
    planner's profile, a test)."""
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    mode = active_fake_mode()
    if mode is None and not whole_process:
        return []
    gc.collect()  # what is garbage now is not held
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    if mode is None:
        return [t for t in tensors if not isinstance(t, FakeTensor)]
    return [t for t in tensors if isinstance(t, FakeTensor) and t.fake_mode is mode]
