"""Each rank's time per phase of a step and its memory, summed over a log window and sent with the loss.

Every rank keeps, for the steps since the last read of the loss window:

    data_s     seconds blocked in the loader's next()
    comm_s     seconds blocked in gradient synchronisation: from this rank's last
               gradient computed in backward (the last parameter's
               post-accumulate-grad hook) to the optimizer's step (its pre-hook),
               which is where DDP's reducer waits for its all-reduces to finish,
               FSDP for its reduce-scatters, a replica group for torchft's
               all-reduce and --max-grad-norm for its norm's all-reduce; plus
               the time of the previous read of the loss window itself; and,
               under FSDP (fsdp, hsdp and their combinations), the time in its
               param groups' waits for each all-gather and in their
               reduce-scatters (with their buffer copies), which otherwise
               fall inside forward and backward: there a rank that waits for a
               slow peer waits at the next all-gather, not at the optimizer
    compute_s  the rest of the step: forward, backward up to its last local
               gradient, the optimizer's step
    step_s     data_s + compute_s + comm_s (host bookkeeping between steps and
               the evaluation are left out)

These are host times from time.perf_counter. On CPU (Gloo) the host is the
device, so they are the phases' real durations; the part of DDP's all-reduce
that overlaps backward counts as compute, and only the exposed wait, which is
the one a slow peer makes longer, counts as communication. On CUDA the host
runs ahead of the GPU and waits only where it syncs, so compute_s is the time
to queue the work and the GPU's time shows up at the next wait: data_s is
still exact, and a slow GPU's peers see the difference as comm_s. A strategy
whose optimizer step does not run through the optimizer's step() (or a step
the fp16 scaler skips) counts its gradient wait as compute.

Memory is read once per window: torch.cuda.max_memory_allocated on a GPU, the
process's resident set (/proc/self/statm) on CPU.

How busy the machine is, also once per window (machine_load.py; Linux, else None):

    cpu_wait_s    seconds per step this rank's main thread waited, ready to run,
                  for a CPU (its run delay): others, or this job's own threads
                  beyond the cores, held them
    others_cores  the cores of this rank's host that other processes kept busy:
                  the host's busy CPU-seconds less its ranks' own, per second

The figures travel to every rank in the collective that reads the loss window
(train/losses.py): the numbers the record's fields send (view/record.py, where
RankWindow is declared, with how each field comes from them), more slots of a
rank's row in the one all-gather that replaces the all-reduce, so they cost no
collective and no host sync of their own. The hosts' names are exchanged once,
through the group's store.
"""

from __future__ import annotations

import math
import os
import resource
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from torchfleet import machine_load
from torchfleet.view.record import RankWindow as RankWindow
from torchfleet.view.record import pack
from torchfleet.view.record import windows as windows

STORE_PREFIX = "torchfleet/ranks"


def memory_now(device: torch.device) -> tuple[int, str]:
    """This process's memory: CUDA's peak allocated bytes on a GPU, its resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    try:
        with open("/proc/self/statm") as statm:  # Linux: pages, the second field resident
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), "rss"
    except OSError:  # macOS: the peak resident set, in bytes there (kilobytes on Linux)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024, "rss"


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's copy of the 1-D `tensor`, as a (world size, n) tensor: one all-gather."""
    if not dist.is_initialized():
        return tensor.unsqueeze(0)
    world = dist.get_world_size()
    flat = tensor.new_empty(world * tensor.numel())  # Gloo wants the flat output, not (world, n)
    # torch 2.14 renamed all_gather_into_tensor to all_gather_single (the old name warns there).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, tensor.contiguous())
    return flat.view(world, -1)


def share_host() -> None:
    """Put this rank's host name in the group's store, once, for the main rank to name it by."""
    if dist.is_initialized():
        _store().set(f"host/{dist.get_rank()}", socket.gethostname())


def hosts(world_size: int) -> list[str]:
    """Every rank's host name (each rank shared it before its first read of the loss window)."""
    if not dist.is_initialized():
        return [socket.gethostname()]
    store = _store()
    return [store.get(f"host/{r}").decode() for r in range(world_size)]


def _store() -> dist.Store:
    return dist.PrefixStore(STORE_PREFIX, dist.distributed_c10d._get_default_store())


class PhaseClock:
    """One rank's step phases, timed on the host and summed until the next read of the loss window.

    The loop iterates `batches(loader)` and calls `trained()` after each train step; the hooks on the
    model's parameters and the optimizer mark where backward's last local gradient and the optimizer's
    step came (the module says why those two points).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.device = device
        self._fetched = self._last_gradient = self._synced = self._ended = 0.0
        self._sums = [0, 0.0, 0.0, 0.0]  # steps, data, compute, comm
        self._data = 0.0
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._gradient_done)
            for param in model.parameters()
            if param.requires_grad
        ]
        self._hooks.append(optimizer.register_step_pre_hook(self._step_starts))
        self._fsdp_blocked = 0.0  # this step's seconds in FSDP's collectives (_time_fsdp_waits)
        self._fsdp_groups = _time_fsdp_waits(model, self)
        self._machine = _MachineWindow()

    def close(self) -> None:
        """Take the hooks off (benchmarks/rank_view_overhead.py times steps with and without them)."""
        for hook in self._hooks:
            hook.remove()
        for group in self._fsdp_groups:  # back to the class's methods
            del group.unshard, group.wait_for_unshard, group.post_backward

    def batches(self, loader: Iterable, before_fetch: Callable[[], None] | None = None) -> Iterator:
        """`loader`'s batches, each fetch timed; `before_fetch` runs inside the timing (a test's slow loader)."""
        batches = iter(loader)
        while True:
            start = time.perf_counter()
            if before_fetch is not None:
                before_fetch()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._fetched = time.perf_counter()
            self._data = self._fetched - start
            self._fsdp_blocked = 0.0  # an evaluation's all-gathers, before this step, are not its own
            yield batch

    def starting(self) -> None:
        """A train step starts: with no fetch timed since the last step (a loader not iterated through
        `batches`), the step's phases start here, its data phase none."""
        if self._fetched <= self._ended:
            self._fetched, self._data, self._fsdp_blocked = time.perf_counter(), 0.0, 0.0

    def trained(self) -> None:
        """A train step has returned: add its phases to the window."""
        end = self._ended = time.perf_counter()
        synced = self._synced if self._synced > self._last_gradient else end
        comm = synced - self._last_gradient if self._last_gradient > self._fetched else 0.0
        comm += self._fsdp_blocked
        self._fsdp_blocked = 0.0
        sums = self._sums
        sums[0] += 1
        sums[1] += self._data
        sums[2] += end - self._fetched - comm
        sums[3] += comm

    def blocked(self, seconds: float) -> None:
        """Time spent in a collective outside the steps (the read of the loss window): communication."""
        self._sums[3] += seconds

    def take(self) -> list[float]:
        """This window's sums to send (view/record.py's `pack`), and a new window started."""
        steps, data, compute, comm = self._sums
        memory, _ = memory_now(self.device)
        self._sums = [0, 0.0, 0.0, 0.0]
        return pack(
            {"steps": steps, "data": data, "compute": compute, "comm": comm, "memory": memory, **self._machine.take()}
        )

    def _gradient_done(self, _param: torch.Tensor) -> None:
        self._last_gradient = time.perf_counter()

    def _step_starts(self, *_args) -> None:
        self._synced = time.perf_counter()


class _MachineWindow:
    """This rank's CPU seconds, its wait for a CPU and its host's busy CPU-seconds since the last `take`."""

    def __init__(self) -> None:
        self._cpus = set(range(os.cpu_count() or 1))  # the whole host: ranks pinned apart still share it
        self._span = machine_load.Span(self._cpus)
        self._delay = machine_load.run_delay_seconds()

    def take(self) -> dict[str, float]:
        """cpu_s, wait_s, busy_s, wall_s and the host's CPUs, cores (NaN where unreadable); a new window started."""
        span, delay = self._span.end(), machine_load.run_delay_seconds()
        wait = delay - self._delay if delay is not None and self._delay is not None else math.nan
        self._span, self._delay = machine_load.Span(self._cpus), delay
        busy = span.busy_s if span.busy_s is not None else math.nan
        return {
            "cpu_s": span.own_cpu_s,
            "wait_s": wait,
            "busy_s": busy,
            "wall_s": span.wall_s,
            "cores": len(self._cpus),
        }


def _time_fsdp_waits(model: torch.nn.Module, clock: PhaseClock) -> list:
    """Time each FSDP param group's all-gather (unshard, wait_for_unshard) and its reduce-scatter
    (post_backward) into `clock`, by wrapping the three methods on this model's group objects; the groups
    wrapped, for `close` to unwrap. The end of a group's post_backward is also a gradient done (its
    post-accumulate-grad hooks run inside it, and not at all on some torch versions)."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is None or not all(hasattr(group, m) for m in ("unshard", "wait_for_unshard", "post_backward")):
            continue

        # On CPU the all-gather runs inside unshard (synchronously); on CUDA it is waited for in wait_for_unshard.
        group.unshard = _timed(group.unshard, clock)
        group.wait_for_unshard = _timed(group.wait_for_unshard, clock)
        group.post_backward = _timed(group.post_backward, clock, gradient_done=True)
        groups.append(group)
    return groups


def _timed(method: Callable, clock: PhaseClock, gradient_done: bool = False) -> Callable:
    """`method`, its time added to `clock`'s FSDP time; with `gradient_done`, its end marks a gradient done."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            end = time.perf_counter()
            clock._fsdp_blocked += end - start
            if gradient_done:
                clock._last_gradient = end

    return timed
