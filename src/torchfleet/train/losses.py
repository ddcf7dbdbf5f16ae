"""Training losses, read on the host once per log interval instead of once per step.

Reading a CUDA tensor on the host (`.item()`, `.tolist()`) waits until the
GPU has finished everything queued before it, so a loop that reads each
step's loss (for a progress bar, or to check it is finite) keeps the GPU's
queue empty between steps. As nanoGPT does, the loss reaches the host every
`--log-every` steps instead: each step copies its loss into a slot of a small
buffer on the device (one kernel, no wait), and a read brings the whole
window over in one transfer. The checks see every step's value, only later:
a non-finite loss is still named by its own step, at the next read. The
trainer reads before every checkpoint, so a diverged model is never saved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from torchfleet.errors import TrainingError

# fp16: this many non-finite losses in a row mean the model diverged, not that
# the scaler's scale needs lowering (each one halved it).
FP16_NONFINITE_LIMIT = 8


class LossWindow:
    """The losses of the steps since the last read, kept on the device that computed them.

    `capacity` is the log interval: the trainer reads at least that often
    (every multiple of it, and at epoch ends and checkpoints), so the window
    never holds more. `gather` brings every rank's copy of a 1-D tensor to
    every rank as a (ranks, n) tensor (rank_figures.gather_rows), so the mean
    a read returns is the whole global batch's, as serial computes it,
    whatever the number of processes.
    """

    def __init__(
        self, capacity: int, rank: int = 0, scaler=None, gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    ):
        self.capacity, self.rank, self.scaler = capacity, rank, scaler
        self._gather = gather or (lambda t: t.unsqueeze(0))
        self._buffer: torch.Tensor | None = None  # made at the first step, where the loss lives
        self._size = 0
        self._first = 0  # the step of the buffer's first slot
        self._streak = 0  # fp16: non-finite losses in a row, carried across windows
        # Whether any rank has asked to leave (worker/preemption.py), as of the last read: every rank
        # reads at the same steps and gets the same sum, so all turn True at the same step.
        self.leave = False
        self.payloads: list[list[float]] = []  # each rank's `payload` at the last read, by rank

    def add(self, loss: torch.Tensor, step: int, injected: bool = False) -> None:
        """Keep `step`'s loss without reading it; `injected`: the fault hook's NaN (faults.py)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity, dtype=torch.float32, device=loss.device)
        if self._size == self.capacity:
            raise RuntimeError(f"the loss window holds {self.capacity} steps; read it before adding more")
        if self._size == 0:
            self._first = step
        slot = self._buffer[self._size]
        slot.fill_(float("nan")) if injected else slot.copy_(loss)
        self._size += 1

    @property
    def pending(self) -> bool:
        """Whether a step ran since the last read (every rank agrees: all read at the same steps)."""
        return self._size > 0

    def read(self, leave: bool = False, payload: Sequence[float] = ()) -> float | None:
        """Bring the window to the host (one sync), check every step's loss, start a new window.

        Returns the mean finite loss of the window over all ranks, or None
        when no step ran since the last read. Raises TrainingError for a
        non-finite loss: at once under fp32 or bf16; under fp16, whose scaler
        skips such steps, after FP16_NONFINITE_LIMIT in a row.

        `leave` is this rank's preemption flag and `payload` its figures of the window (the same
        number of them on every rank: run_services/rank_figures.py). They ride in the same all-gather as the
        losses, more slots of each rank's row, so they cost no collective and no host sync of their
        own; any rank's flag turns `self.leave` True, and `self.payloads` holds every rank's figures.
        """
        if self._size == 0:
            return None
        assert self._buffer is not None  # made by the first add
        size = self._size
        local = self._buffer[:size].double()
        extra = torch.tensor([float(leave), *payload], dtype=torch.float64)
        if local.is_cuda:  # from pinned memory the copy is queued, not waited for: the sync stays the one below
            extra = extra.pin_memory().to(local.device, non_blocking=True)
        sent = torch.cat([local, extra])
        rows = self._gather(sent).to(local.device, torch.float64)
        flat = torch.cat([local, rows.flatten()]).tolist()  # the one host sync
        values, width = flat[:size], size + 1 + len(payload)
        table = [flat[size + i * width : size + (i + 1) * width] for i in range(rows.shape[0])]
        means = [sum(row[step] for row in table) / len(table) for step in range(size)]
        self.leave = self.leave or any(row[size] > 0 for row in table)
        self.payloads = [row[size + 1 :] for row in table]
        first, last = self._first, self._first + size - 1
        self._size = 0
        for step, value in enumerate(values, start=first):
            self._check(value, step, first, last)
        finite = [m for m in means if math.isfinite(m)]  # fp16: a skipped step's loss is inf or NaN
        return sum(finite) / len(finite) if finite else float("nan")

    def _check(self, value: float, step: int, first: int, last: int) -> None:
        if math.isfinite(value):
            self._streak = 0
            return
        # When the read came later than the step, say so: the run went on until the read.
        late = (
            ""
            if step == last
            else (
                f" at step {last}, which read the losses of steps {first}-{last} together (--log-every {self.capacity})"
            )
        )
        if self.scaler is None:
            raise TrainingError(
                f"the loss is {value} at step {step} on rank {self.rank}; training stopped{late}"
                " (lower --lr, or use --precision fp32 if it was bf16)"
            )
        self._streak += 1
        if self._streak >= FP16_NONFINITE_LIMIT:
            raise TrainingError(
                f"the loss has been {value} for {self._streak} steps in a row up to step {step} on"
                f" rank {self.rank}, though the fp16 scaler skipped each one and lowered its scale"
                f" to {self.scaler.get_scale():g}; training stopped{late}"
                " (lower --lr, or use --precision bf16 or fp32)"
            )
