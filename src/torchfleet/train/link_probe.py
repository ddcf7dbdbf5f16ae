"""A slow link: found by probing each rank's own link, once every rank's gradient sync has slowed together.

A rank slow in data or compute keeps the others waiting at the gradient
sync, and run_services/stragglers.py names it by its own phase. A slow link out of
one host does not single out its rank that way: a ring all-reduce (Gloo's, and
NCCL's) passes every chunk from rank to rank, so each rank waits as long as
the slowest hop, and every rank's comm_s rises alike. Measured on four
network-namespace hosts training the cnn under ddp, with a tbf limit of
50 Mbit/s on one host's link from step 1: every rank's comm_s was 140-155 ms a
step, the slowed rank's among them; without the limit, 6-17 ms on every rank.

So every rank watches the gathered figures for that pattern (LinkWatch):
every rank's comm_s above the run's earlier level by more than RISE and
stragglers.FLOOR_S, for stragglers.WINDOWS windows in a row. Every rank means the
slow one too: a rank slow in data or compute arrives last at the sync and waits
least, so it does not start the probe. The run's level is the median of the
earlier windows' median comm_s, every window but the warm-up counted. On a
busy machine some rank is slow in compute in most windows; a level that left
those windows out had none left before the link was limited, and then took the
limited windows for its level (CI, 30 Nov 2026: every rank's sync rose from
45 ms to 165 ms and no probe ran). A level of each window's least comm_s was
too low the other way: with one rank slowed 30 ms in compute, that rank's own
sync, noisy under CI's load, rose 20% above it for three windows and the probe
ran for nothing. A window's median counts the others' waits for a slow rank,
which a limited link's rise clears and noise does not: 10 times the level on
an idle machine, 1.5 to 2.3 times under CI's load (30 Nov), whose level rises
with it. Every rank holds the same
figures (the loss window's all-gather, train/losses.py) and applies the same
rule to them, so all decide at the same read and need no message to agree.

Then, once per such streak, every rank runs the probe (`send_seconds`): in
two rounds each rank sends PROBE_BYTES to one ring neighbour and receives as
many from the other, first to the right, then to the left, and times its
receive, the least of TRIES such pairs of rounds; one all-gather brings the
times to every rank. A rank's send time is
the faster of its two outgoing links' (each timed by its receiver), so a rank
is named only when both its links out are slow: its own egress, not one
neighbour's slow way in. It is named (`verdicts`) when that time exceeds the
other ranks' median by more than LINK_SLOWER and by FLOOR_S, and is at least BESIDE_SLOWEST of the slowest
rank's (the link that holds the ring back, not a busy machine's noise beside it). With two ranks
the two links out are one link, so the rank named may be the one at its other
end, with a slow way in.

The probe and its gather are collectives of their own, run only after the
anomaly, never in a job whose gradient sync keeps its level, not under
replica groups (whose members may leave between two rounds), and not in a
job whose ranks are all on one host (LOCAL_WORLD_SIZE is WORLD_SIZE): no
link joins them. There, on a machine six other processes kept busy, one
probe of loopback timed rank 0 at 105 to 145 MB/s against 550 to 780 for
rank 1 and named it, in three runs of three. The per-step path is
unchanged.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from torchfleet.env import DistEnv
from torchfleet.run_services.rank_figures import RankWindow, gather_rows
from torchfleet.run_services.stragglers import FLOOR_S, WINDOWS, Verdict

PROBE_BYTES = 2 << 20  # several times the probe's own timing noise on a fast link; 0.3 s at 50 Mbit/s
LINK_SLOWER = 1.0  # a link is slow at under half the others' median rate
# A ring waits for its slowest hop, so a link many times faster than the slowest one is not what holds the
# gradient sync back, however it compares with the others' median: a busy machine's probe timed one link at half
# the median's rate beside a limited one at a sixtieth, and both were named. Named: within this of the slowest.
BESIDE_SLOWEST = 0.5
# A link's limit holds in every round; a busy machine's late sender or receiver holds up only some, so each
# link's time is its least of TRIES rounds.
TRIES = 3
HISTORY = 2  # windows of the earlier level needed before a rise counts
RISE = 0.2  # every rank's gradient sync this much above its earlier level: the probe runs


class LinkWatch:
    """Every rank's copy of the rule that starts the probe: the same records give the same answer everywhere."""

    def __init__(self) -> None:
        self._levels: list[float] = []  # the median comm_s of each earlier window without a rise
        self._seen = 0
        self._streak = 0

    def rose(self, records: list[RankWindow]) -> float | None:
        """The earlier level (seconds per step) when this window completes a streak of every rank's
        comm_s risen above it; None otherwise (most windows)."""
        if len(records) < 2 or not all(r.steps for r in records):
            return None
        self._seen += 1
        before = statistics.median(self._levels) if len(self._levels) >= HISTORY else None
        if before is not None and all(r.comm_s > before * (1 + RISE) and r.comm_s - before > FLOOR_S for r in records):
            self._streak += 1
            return before if self._streak == WINDOWS else None
        self._streak = 0
        if self._seen > 1:  # the warm-up window is not the level
            self._levels.append(statistics.median(r.comm_s for r in records))
        return None


def watch(env: DistEnv, replica_groups: bool) -> LinkWatch | None:
    """The rule's watch for this job, or None where no probe may run: under replica groups (members may leave
    between the probe's rounds) and where every rank is on this host (no link joins them)."""
    if replica_groups or env.local_world_size >= env.world_size:
        return None
    return LinkWatch()


def probe(device: torch.device, nbytes: int = PROBE_BYTES, tries: int = TRIES) -> list[float]:
    """This rank's seconds to receive `nbytes` from its left neighbour (round one) and from its right (round two),
    each the least of `tries` rounds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    outgoing = torch.ones(nbytes // 4, device=device)
    incoming = torch.empty_like(outgoing)
    seconds = [float("inf"), float("inf")]
    for _ in range(tries):
        for way, hop in enumerate((1, -1)):
            dist.barrier()  # every rank starts the round together, so each receive times the link alone
            start = time.perf_counter()
            sent = dist.isend(outgoing, (rank + hop) % world)
            received = dist.irecv(incoming, (rank - hop) % world)
            assert sent is not None and received is not None  # None only for a rank outside the group
            received.wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[way] = min(seconds[way], time.perf_counter() - start)
            sent.wait()
    return seconds


def send_seconds(device: torch.device, nbytes: int = PROBE_BYTES) -> list[float]:
    """Every rank's send time (the faster of its two links out), by rank: the probe on every rank, one all-gather."""
    table = gather_rows(torch.tensor(probe(device, nbytes), dtype=torch.float64, device=device)).tolist()
    world = len(table)
    # Rank r's first-round send is r+1's receive from the left; its second-round one r-1's from the right.
    return [min(table[(r + 1) % world][0], table[(r - 1) % world][1]) for r in range(world)]


def verdicts(records: list[RankWindow], sends: list[float], before: float, nbytes: int = PROBE_BYTES) -> list[Verdict]:
    """The ranks whose link out is slow: `sends` from send_seconds, `before` the level LinkWatch.rose gave."""
    named = []
    slowest = max(sends)
    for record, mine in zip(records, sends, strict=True):
        others = statistics.median(s for r, s in zip(records, sends, strict=True) if r is not record)
        if mine > others * (1 + LINK_SLOWER) and mine - others > FLOOR_S and mine >= slowest * BESIDE_SLOWEST:
            named.append(
                Verdict(
                    record.step,
                    record.rank,
                    record.host,
                    "communication",
                    record.comm_s,
                    before,
                    record.comm_s / before - 1 if before > 0 else float("inf"),
                    WINDOWS,
                    send_mb_s=nbytes / mine / 1e6,
                    others_mb_s=nbytes / others / 1e6,
                )
            )
    return named


def found(sends: list[float], named: list[Verdict], nbytes: int = PROBE_BYTES) -> str:
    """What the probe measured, one sentence: every rank's link's rate out, and which is slow, if any."""
    rates = ", ".join(f"rank {r} {nbytes / s / 1e6:,.1f}" for r, s in enumerate(sends))
    slow = [v.rank for v in named]
    verdict = (
        f"rank {', '.join(map(str, slow))}'s link is slow (below half the others' median)"
        if slow
        else "no rank's link is below half the others' median: the rise is not one link's"
    )
    return f"the link probe sent {nbytes / 2**20:g} MiB out of each rank: MB/s {rates}; {verdict}"
