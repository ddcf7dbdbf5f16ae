"""The time of each collective, from its message size, the number of ranks and the link.

Ring algorithms, as Gloo and NCCL run them for large messages (Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005):

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


@dataclass(frozen=True)
class Link:
    """A link between ranks: bus bandwidth in bytes/s and per-message latency in seconds."""

    bandwidth: float
    latency: float = 0.0

    def as_dict(self) -> dict:
        return {"bandwidth_bytes_s": self.bandwidth, "latency_s": self.latency}


def all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / link.bandwidth + 2 * (ranks - 1) * link.latency


def all_gather_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / link.bandwidth + (ranks - 1) * link.latency


def reduce_scatter_s(nbytes: float, ranks: int, link: Link) -> float:
    return all_gather_s(nbytes, ranks, link)  # the same traffic, in the other direction


def send_s(nbytes: float, link: Link) -> float:
    return nbytes / link.bandwidth + link.latency if nbytes > 0 else 0.0


def all_to_all_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * send_s(nbytes / ranks, link)


def bucketed_all_reduce_s(nbytes: float, ranks: int, link: Link, bucket_bytes: float) -> tuple[float, float]:
    """(all of it, the last bucket alone) for gradients all-reduced in buckets of `bucket_bytes`, as DDP does.

    DDP launches a bucket's all-reduce as soon as backward has filled it, so all
    but the last bucket can hide behind the rest of backward; the last one
    cannot (it is filled when backward ends).
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0, 0.0
    buckets = max(1, -(-int(nbytes) // int(bucket_bytes)))
    whole = 2 * (ranks - 1) / ranks * nbytes / link.bandwidth + buckets * 2 * (ranks - 1) * link.latency
    last = all_reduce_s(min(nbytes, bucket_bytes), ranks, link)
    return whole, last
