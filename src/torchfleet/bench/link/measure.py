"""bench's link mode: the link's speed, from all-reduces of a known size between the machines.

The figure is the preflight's (launcher/preflight.py), taken again with repeats so one slow moment does not
decide it: the bus bandwidth of a Gloo all-reduce of ALLREDUCE_BYTES among the N machines, one process
each, over the interface that routes to the master. A ring all-reduce sends 2(N-1)/N of the data out of
every machine, so

    Mbit/s = bytes x 2(N-1)/N x 8 / (median time of REPEATS all-reduces) / 1e6

which on two machines is what the link carries each way at once. TCP's and Gloo's own overheads keep it a
few percent under the wire's rate; it is what ddp's gradient all-reduce over Gloo sees.
"""

from __future__ import annotations

import datetime
import statistics
import time
from dataclasses import asdict, dataclass

from torchfleet.errors import TrainingError
from torchfleet.launcher.preflight import ALLREDUCE_BYTES

REPEATS = 3
_PREFIX = "torchfleet/bench/link/"


@dataclass(frozen=True)
class Link:
    mbit_s: float
    seconds: list[float]  # each timed all-reduce, on this machine
    bytes: int
    nodes: int
    interface: str
    method: str

    def sentence(self) -> str:
        return (
            f"{self.mbit_s:,.0f} Mbit/s between {self.nodes} machines (all-reduce of"
            f" {self.bytes / 2**20:g} MiB over {self.interface}, median of {len(self.seconds)}:"
            f" {statistics.median(self.seconds) * 1e3:.0f} ms)"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def bus_mbit_s(nbytes: int, nodes: int, seconds: float) -> float:
    return nbytes * 2 * (nodes - 1) / nodes * 8 / seconds / 1e6


def measure(store, node: int, nodes: int, interface: str) -> Link:
    """Time REPEATS all-reduces of ALLREDUCE_BYTES on every machine at once (each machine calls this).

    GLOO_SOCKET_IFNAME must name `interface` already (run.py sets it from the preflight's route), or Gloo
    advertises the host name's address, often 127.0.0.1, and the machines never connect.
    """
    import torch
    import torch.distributed as dist

    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore(_PREFIX, store), node, nodes, datetime.timedelta(seconds=120))
        # A first small one opens the connections, which a timed one must not pay for.
        group.allreduce([torch.ones(8)]).wait()  # pyright: ignore[reportAttributeAccessIssue] (torch's Backend stub omits allreduce)
        data = torch.ones(ALLREDUCE_BYTES // 4)
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            group.allreduce([data]).wait()  # pyright: ignore[reportAttributeAccessIssue] (as above)
            seconds.append(time.perf_counter() - start)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise TrainingError(f"node {node}: the link's all-reduce over {interface} failed ({first})") from None
    mbit = bus_mbit_s(ALLREDUCE_BYTES, nodes, statistics.median(seconds))
    method = (
        f"bus bandwidth of a Gloo all-reduce of {ALLREDUCE_BYTES // 2**20} MiB among the {nodes} machines over"
        f" {interface}: bytes x 2(N-1)/N x 8 / median time of {REPEATS}"
    )
    return Link(mbit, seconds, ALLREDUCE_BYTES, nodes, interface, method)
