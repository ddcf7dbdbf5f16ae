"""`notebook_launch`: run a function defined in a Jupyter notebook on N processes.

    def train(epochs):
        fleet = torchfleet.Fleet(strategy="ddp")
        ...
        return accuracy

    results = torchfleet.notebook_launch(train, nprocs=2, args=(3,))  # one result per rank

The processes are started as every torchfleet launch is: by torchrun's agent,
with the spawn start method. A function defined in a notebook lives in the
kernel's ``__main__``, which a spawned interpreter cannot import, so it is
sent *by value*: cloudpickle serialises the function, the globals it uses
and its arguments, and each worker rebuilds them. We do not fork instead:
forking copies a kernel that already runs threads (ZeroMQ, heartbeats,
torch's intra-op pool), and a lock held by one of those threads at the fork
stays locked forever in the child; and a forked child cannot use CUDA once
the parent has. The price of by-value: what the function uses must be
picklable by cloudpickle (tensors, modules and plain data are; open files
and sockets are not).

CUDA must not be initialised in the kernel before the launch: the kernel
would keep a context and memory on the first GPU that its workers need, so
`notebook_launch` refuses with a `UsageError` and says to restart the kernel.
Worker output goes to the kernel's terminal, not the cell: return what you
want to see.
"""

from __future__ import annotations

from typing import Any, Callable

from torchfleet.errors import UsageError


class _ByValue:
    """`fn(*args)` carried as cloudpickle bytes; itself picklable by reference (spawn)."""

    def __init__(self, fn: Callable, args: tuple):
        import cloudpickle

        self.payload = cloudpickle.dumps((fn, tuple(args)))
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)  # the agent logs it
        self.__qualname__ = self.__name__

    def __call__(self) -> Any:
        import cloudpickle

        fn, args = cloudpickle.loads(self.payload)
        return fn(*args)


def check_cuda_untouched() -> None:
    import torch

    if torch.cuda.is_initialized():
        raise UsageError(
            "CUDA was initialised in this kernel before notebook_launch; restart "
            "the kernel and launch before any cell touches the GPU "
            "(each worker needs the GPUs for itself)"
        )


def notebook_launch(fn: Callable, nprocs: int = 2, args: tuple = (), max_restarts: int = 0) -> list[Any]:
    """Run ``fn(*args)`` in `nprocs` processes; return each rank's result, rank 0 first.

    `fn` may be defined in the notebook. A failure raises `LaunchError` naming the first
    failing rank, with its traceback.
    """
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        raise UsageError(
            "notebook_launch needs cloudpickle to send notebook functions to "
            "its processes: pip install cloudpickle (or torchfleet[notebook])"
        ) from None
    check_cuda_untouched()
    from torchfleet.launcher.agent import launch

    return launch(_ByValue(fn, args), nprocs=nprocs, max_restarts=max_restarts)
