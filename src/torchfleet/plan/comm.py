"""The time of each collective, from its message size, the number of ranks and the link.

Between GPUs (a link that names its hardware, `Link.hw`), as NCCL runs them: ring or tree by size and
scale, each with its own latency, over the nodes the group spans (plan/nccl.py). Between CPU processes,
ring algorithms as Gloo runs them (Thakur, Rabenseifner and Gropp, "Optimization of Collective
Communication Operations in MPICH", 2005):

    all-reduce      2(N-1)/N x bytes / bandwidth + 2(N-1) x latency
    all-gather      (N-1)/N x bytes / bandwidth + (N-1) x latency   (bytes: the gathered whole)
    reduce-scatter  (N-1)/N x bytes / bandwidth + (N-1) x latency   (bytes: the whole before scattering)
    send/recv       bytes / bandwidth + latency
    all-to-all      (N-1)/N x bytes / bandwidth + (N-1) x latency   (bytes: what one rank sends, its own
                    share among them; pairwise exchange, as Gloo runs it: N-1 sends of bytes/N)

`bandwidth` is the bus bandwidth in bytes/s (what each rank's link carries each
way), `latency` the cost of one message in seconds. One rank (N = 1) costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchfleet.plan import nccl


@dataclass(frozen=True)
class Link:
    """A link between ranks: bus bandwidth in bytes/s and per-message latency in seconds. Between GPUs also `hw`,
    the link inside a node ("nvlink" or "pci"), and `nodes`, how many nodes the group spans: NCCL's collectives
    (plan/nccl.py) then take their latencies from those; without `hw`, Gloo's rings pay `latency` a hop."""

    bandwidth: float
    latency: float = 0.0
    hw: str = ""
    nodes: int = 1

    def as_dict(self) -> dict:
        return {"bandwidth_bytes_s": self.bandwidth, "latency_s": self.latency}


def _nccl(kind: str, nbytes: float, ranks: int, link: Link) -> float:
    return nccl.collective_s(kind, nbytes, ranks, link.nodes, link.bandwidth, link.hw)[0]


def all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if link.hw:
        return _nccl("all_reduce", nbytes, ranks, link)
    return 2 * (ranks - 1) / ranks * nbytes / link.bandwidth + 2 * (ranks - 1) * link.latency


def all_gather_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if link.hw:
        return _nccl("all_gather", nbytes, ranks, link)
    return (ranks - 1) / ranks * nbytes / link.bandwidth + (ranks - 1) * link.latency


def reduce_scatter_s(nbytes: float, ranks: int, link: Link) -> float:
    if link.hw and ranks > 1 and nbytes > 0:
        return _nccl("reduce_scatter", nbytes, ranks, link)
    return all_gather_s(nbytes, ranks, link)  # the same traffic, in the other direction


def send_s(nbytes: float, link: Link) -> float:
    return nbytes / link.bandwidth + link.latency if nbytes > 0 else 0.0


def all_to_all_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * send_s(nbytes / ranks, link)


def buckets(nbytes: float, bucket_bytes: float, first_bytes: float) -> list[float]:
    """DDP's buckets of `nbytes` of gradients: the first (the last layers', ready first) of at most
    `first_bytes`, the rest of at most `bucket_bytes` each."""
    if nbytes <= 0:
        return []
    first = min(nbytes, first_bytes)
    rest = nbytes - first
    full, left = divmod(rest, bucket_bytes)
    return [first] + [bucket_bytes] * int(full) + ([left] if left > 0 else [])


def bucketed_all_reduce_s(
    nbytes: float, ranks: int, link: Link, bucket_bytes: float, first_bytes: float | None = None
) -> tuple[float, float]:
    """(all of it, the last bucket alone) for gradients all-reduced in buckets, as DDP fills them (`first_bytes`,
    then `bucket_bytes` each; one size when `first_bytes` is None), each bucket its own call.

    DDP launches a bucket's all-reduce as soon as backward has filled it, so all
    but the last bucket can hide behind the rest of backward; the last one
    cannot (it is filled when backward ends).
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0, 0.0
    sizes = buckets(nbytes, bucket_bytes, bucket_bytes if first_bytes is None else first_bytes)
    return sum(all_reduce_s(size, ranks, link) for size in sizes), all_reduce_s(sizes[-1], ranks, link)
