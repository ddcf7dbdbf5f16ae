"""Running hogwild: N worker processes on one machine sharing one model's memory.

Every other multi-process strategy starts its workers through torchrun's
agent, which launches fresh interpreters that meet in a process group. Hogwild
workers must instead receive the parent's tensors themselves (the storages are
handed over as shared-memory handles when the workers are spawned), so this
process stays the parent: it shares the model, spawns the workers with
`torch.multiprocessing`, waits for them, and afterwards holds the trained
model. `torchfleet train --strategy hogwild -n 4` runs through here
(torchfleet/train/hogwild.py).

    from torchfleet import hogwild

    def work(model, dataset):              # module-level, runs in each worker
        fleet = torchfleet.Fleet(strategy="hogwild")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # each worker its own
        model, optimizer = fleet.setup(model, optimizer)
        for inputs, targets in fleet.dataloader(dataset, batch_size=64):  # its share
            fleet.train_step(inputs, targets, loss_fn)

    hogwild.run(work, model, nprocs=4, args=(dataset,))   # model is now trained

A run leaves nothing behind: afterwards the model's tensors are copied back
into private memory, which releases the shared segments (and, with the
file_descriptor strategy, their file descriptors).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from torchfleet.errors import UsageError
from torchfleet.hogwild import worker as worker_side
from torchfleet.hogwild.worker import WorkerInfo, resolve_sharing_strategy
from torchfleet.launcher import failures


def run(
    fn: Callable, model: nn.Module, nprocs: int = 2, args: tuple = (), sharing_strategy: str | None = None
) -> list[Any]:
    """Run ``fn(model, *args)`` in `nprocs` workers sharing `model`; return each worker's result.

    Tensors in `args` (a TensorDataset, say) are shared the same way, read-only
    by convention. Results travel back pickled: keep them small and plain
    (numbers, not tensors). A worker's UsageError is raised here as a
    UsageError; any other failure raises `torchfleet.launcher.LaunchError`
    naming the first failing worker and holding its traceback.
    """
    if nprocs < 1:
        raise UsageError(f"nprocs {nprocs} must be at least 1")
    strategy = resolve_sharing_strategy(sharing_strategy)
    if not os.environ.get("TORCHFLEET_VERBOSE"):
        # spawn logs each worker it stops after a failure; the summary says it once.
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    previous = mp.get_sharing_strategy()
    # The strategy is process-wide and decides how share_memory() allocates: set it first.
    mp.set_sharing_strategy(strategy)
    # One pipe per worker for its result: unlike a multiprocessing queue, a
    # pipe needs no named semaphore, which would be one more /dev/shm entry.
    pipes = [mp.get_context("spawn").Pipe(duplex=False) for _ in range(nprocs)]
    context = None
    try:
        model.share_memory()
        context = mp.start_processes(
            _worker,
            args=(fn, model, nprocs, strategy, [w for _, w in pipes], args),
            nprocs=nprocs,
            join=False,
            start_method="spawn",
        )
        assert context is not None  # join=False: start_processes returns the context
        for _, writer in pipes:
            writer.close()  # the workers hold their own copies now
        got: dict[int, tuple[str, Any]] = {}
        try:
            while not context.join(timeout=0.2):
                _collect(pipes, got)
        except ProcessException as exc:
            _collect(pipes, got)
            usage = [value for kind, value in got.values() if kind == "usage"]
            if usage:
                raise UsageError(usage[0]) from None
            from torchfleet.launcher.agent import LaunchError

            raise LaunchError(_summary(exc)) from None
        _collect(pipes, got)
        return [got[rank][1] for rank in range(nprocs)]
    finally:
        if context is not None:
            # list[Any]: torch's ProcessContext is unannotated and the checker reads its list as list[None]
            processes: list[Any] = context.processes
            for process in processes:
                if process.is_alive():  # only when this process was interrupted
                    process.terminate()
                process.join()
                process.close()  # its sentinel pipe, now rather than at garbage collection
        for reader, writer in pipes:
            reader.close()
            writer.close()
        # Private copies drop this process's references to the shared storages:
        # each segment is unlinked and its descriptor closed (the workers let go of theirs in
        # _worker). Parameters keep their identity, so an optimizer built on them still works.
        _release((model, args), lambda t: t.clone())
        mp.set_sharing_strategy(previous)


def _collect(pipes, got: dict) -> None:
    for rank, (reader, _) in enumerate(pipes):
        if rank not in got and reader.poll():
            try:
                got[rank] = reader.recv()
            except EOFError:  # the worker died before it could answer
                got[rank] = ("lost", None)


@torch.no_grad()
def _release(obj, replace: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Give every shared tensor reachable from `obj` new data: `replace(tensor)`."""
    if isinstance(obj, torch.Tensor):
        if obj.is_shared():
            obj.data = replace(obj.data)
    elif isinstance(obj, nn.Module):
        for tensor in [*obj.parameters(), *obj.buffers()]:
            _release(tensor, replace)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _release(item, replace)
    elif isinstance(obj, dict):
        for item in obj.values():
            _release(item, replace)
    elif isinstance(getattr(obj, "tensors", None), tuple):  # TensorDataset
        _release(obj.tensors, replace)


def _summary(exc: ProcessException) -> failures.FailureSummary:
    if isinstance(exc, ProcessExitedException):
        code, trace = exc.exit_code, ""  # negative for a signal, as the agent reports it
    else:  # raised: spawn's message holds the worker's traceback
        code, trace = 1, str(exc).split("terminated with the following error:\n", 1)[-1]
    return failures.FailureSummary(
        failures.RankFailure(
            rank=exc.error_index,
            local_rank=exc.error_index,
            host=socket.gethostname(),
            pid=exc.error_pid,
            exitcode=code,
            traceback=trace,
        )
    )


def _worker(index: int, fn: Callable, model: nn.Module, world: int, strategy: str, writers, args: tuple) -> None:
    mp.set_sharing_strategy(strategy)  # for anything this worker shares in turn
    # Workers split the cores instead of each starting one thread per core.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    worker_side._worker = WorkerInfo(index, world, strategy)
    try:
        answer = ("ok", fn(model, *args))
    except UsageError as exc:
        answer = ("usage", str(exc))
    finally:
        # An exiting interpreter does not free every tensor, and a shared
        # segment's count of users only falls when one is freed: let go of them
        # here, or file_system segments outlive the run in /dev/shm.
        _release((model, args), lambda t: torch.empty(0, dtype=t.dtype))
        gc.collect()
    writers[index].send(answer)
    if answer[0] == "usage":
        sys.exit(failures.USAGE_EXIT)
