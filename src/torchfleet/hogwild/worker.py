"""hogwild: worker processes on one machine update one shared model without locks.

This is the worker's side. `torchfleet.hogwild.run` puts the model's tensors
in shared memory, starts the workers and tells each one which it is
(`worker_info()`, as `torch.utils.data.get_worker_info()` does for DataLoader
workers); inside a worker, `Fleet(strategy="hogwild")` trains the shared model
with the worker's own optimizer on the worker's share of every global batch.
There is no process group and no gradient exchange: each worker's optimizer
step writes straight into the shared parameters (Recht et al., "Hogwild!",
2011), so the others see it on their next forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.multiprocessing as mp

from torchfleet.errors import UsageError
from torchfleet.strategies.base import Strategy


@dataclass(frozen=True)
class WorkerInfo:
    rank: int  # this worker, 0 to world_size - 1
    world_size: int  # workers sharing the model
    sharing_strategy: str


_worker: WorkerInfo | None = None  # set by hogwild/runner.py in each worker process


def worker_info() -> WorkerInfo | None:
    """Which hogwild worker this process is; None outside a worker."""
    return _worker


def resolve_sharing_strategy(name: str | None) -> str:
    """`name`, checked against what this platform offers; the platform's default for None."""
    offered = sorted(mp.get_all_sharing_strategies())
    if name is None:
        return mp.get_sharing_strategy()
    if name not in offered:
        raise UsageError(f"unknown sharing strategy {name!r}; this platform offers {', '.join(offered)}")
    return name


class Hogwild(Strategy):
    takes = ("sharing_strategy",)
    # Shared CPU memory is the whole point; CUDA tensors would need CUDA IPC
    # and one context per worker on the same device, which only slows it down.
    cpu_only = True

    def __init__(self, runtime, options=None):
        super().__init__(runtime, options)
        given = options.single_process.sharing_strategy if options is not None else None
        self.sharing_strategy = resolve_sharing_strategy(given)
        self.worker = worker_info()
        if self.worker is None:
            self.notes.append("hogwild outside torchfleet.hogwild.run has one worker; running it as serial")

    def wrap(self, model, optimizer, args):
        if self.worker is not None:
            private = [n for n, t in model.state_dict().items() if not t.is_shared()]
            if private:
                raise UsageError(
                    f"hogwild worker {self.worker.rank} got a model whose {private[0]!r} is not in shared"
                    " memory; train the model passed to torchfleet.hogwild.run, not a new one"
                )
        return super().wrap(model, optimizer, args)

    def data_coords(self) -> tuple[int, int]:
        # Each worker takes its slice of every global batch: the workers see, together,
        # the samples one serial process would see.
        if self.worker is None:
            return 0, 1
        return self.worker.rank, self.worker.world_size
