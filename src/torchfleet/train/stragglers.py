"""Straggler verdicts: which rank keeps the others waiting, on which host, by how much, in which phase.

The main rank judges each log window's records (train/rank_figures.py). A
rank is slow in a phase when its seconds per step there exceed the median of
the other ranks' by more than SLOWER (a fraction) and by more than FLOOR_S
(noise on a busy machine); it is named once it has been slow in that phase
for WINDOWS log windows in a row, and again only after a window without.

In a synchronous job every rank's step ends together: the ranks that wait
for a slow one show the wait as communication. So communication is judged
only in windows where no rank is slow in data or compute; then a rank whose
gradient sync alone is slow is named for it. A slow link out of one host
slows every rank's gradient sync alike (a ring all-reduce waits for its
slowest hop), so no rank stands out here: train/link_probe.py sees every
rank's communication rise together, probes each rank's link, and names the
rank whose link sends slowly (a Verdict with `send_mb_s`).

Memory is judged the same way: a rank whose memory rose by more than
GROWTH_FLOOR bytes in each of MEMORY_WINDOWS windows in a row is named.
A replica group leaving or joining the quorum is named as it happens.
"""

from __future__ import annotations

import dataclasses
import statistics

from torchfleet.train.rank_figures import RankWindow

SLOWER = 0.2
FLOOR_S = 0.005
WINDOWS = 3
MEMORY_WINDOWS = 5
GROWTH_FLOOR = 4 << 20
PHASES = {"data": "data_s", "compute": "compute_s", "communication": "comm_s"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One named rank: a metrics row of kind "straggler", and `line` on the main rank's output.

    `phase` is data, compute or communication (`value` and `median` in seconds per step, `slower` the
    fraction above the others' median), memory (`value` the bytes now, `median` the bytes when it began
    to grow, `slower` the growth as a fraction), or membership (`value` the groups in the quorum now,
    `median` before; rank and host are the main rank's). A communication verdict from the link probe
    (train/link_probe.py) has `send_mb_s`, the rank's link's measured rate, and `others_mb_s`, the other
    ranks' median; its `value` is its comm_s now and `median` every rank's level before the rise.
    """

    step: int
    rank: int
    host: str
    phase: str
    value: float
    median: float
    slower: float
    windows: int
    send_mb_s: float | None = None
    others_mb_s: float | None = None

    def line(self) -> str:
        if self.phase == "membership":
            went = "left" if self.value < self.median else "joined"
            return (
                f"straggler: a replica group {went} the quorum at step {self.step}: {self.value:.0f} groups"
                f" now, {self.median:.0f} before"
            )
        where = f"rank {self.rank} (host {self.host})"
        if self.phase == "memory":
            return (
                f"straggler: {where} memory grew in each of {self.windows} log windows up to step {self.step}:"
                f" {_mib(self.median)} to {_mib(self.value)} (+{self.slower:.0%})"
            )
        if self.send_mb_s is not None:
            return (
                f"straggler: {where} is slow in communication: its link sends at {self.send_mb_s:.1f} MB/s, the"
                f" other ranks' median {self.others_mb_s:.1f} MB/s; every rank's gradient sync rose from"
                f" {self.median * 1e3:.1f} to {self.value * 1e3:.1f} ms a step, for {self.windows} log windows"
                f" up to step {self.step}"
            )
        how = f"{self.slower + 1:.1f} times" if self.slower >= 1 else f"{self.slower:.0%} above"
        return (
            f"straggler: {where} is slow in {self.phase}: {self.value * 1e3:.1f} ms a step, {how} the other"
            f" ranks' median of {self.median * 1e3:.1f} ms, for {self.windows} log windows up to step {self.step}"
        )

    def row(self) -> dict:
        return {**dataclasses.asdict(self), "message": self.line()}


def slow_ranks(records: list[RankWindow], field: str) -> set[int]:
    """The ranks slow in `field` this window: above the other ranks' median by SLOWER and by FLOOR_S."""
    slow = set()
    for record in records:
        others = statistics.median(getattr(r, field) for r in records if r is not record)
        mine = getattr(record, field)
        if mine > others * (1 + SLOWER) and mine - others > FLOOR_S:
            slow.add(record.rank)
    return slow


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class StragglerWatch:
    """The verdicts over a run's windows: streaks per rank and phase, each named once per streak."""

    def __init__(self) -> None:
        self._streaks: dict[tuple[int, str], int] = {}
        self._memory: dict[int, tuple[int, float, float]] = {}  # rank: (windows grown, bytes at start, last)
        self._participants: int | None = None

    def judge(self, records: list[RankWindow]) -> list[Verdict]:
        """The verdicts that this window's records complete (most windows: none)."""
        if len(records) < 2 or not all(r.steps for r in records):
            return self._memory_verdicts(records)
        verdicts, slow = [], set()
        for phase, field in PHASES.items():
            if phase == "communication" and slow:
                break  # the others waited for the slow rank: their wait is not their own slowness
            now = slow_ranks(records, field)
            slow |= now
            for record in records:
                key = (record.rank, phase)
                if record.rank in now:
                    self._streaks[key] = self._streaks.get(key, 0) + 1
                    if self._streaks[key] == WINDOWS:
                        mine = getattr(record, field)
                        others = statistics.median(getattr(r, field) for r in records if r is not record)
                        slower = mine / others - 1 if others > 0 else float("inf")
                        verdicts.append(
                            Verdict(record.step, record.rank, record.host, phase, mine, others, slower, WINDOWS)
                        )
                else:
                    self._streaks[key] = 0
        return verdicts + self._memory_verdicts(records)

    def membership(self, step: int, participants: int, rank: int, host: str) -> list[Verdict]:
        """A replica group that left or joined the quorum since the last read."""
        before, self._participants = self._participants, participants
        if before is None or before == participants:
            return []
        return [Verdict(step, rank, host, "membership", participants, before, participants / before - 1, 1)]

    def _memory_verdicts(self, records: list[RankWindow]) -> list[Verdict]:
        verdicts = []
        for r in records:
            grown, start, last = self._memory.get(r.rank, (0, r.memory_bytes, r.memory_bytes))
            if r.memory_bytes - last > GROWTH_FLOOR:
                grown += 1
            else:
                grown, start = 0, r.memory_bytes
            self._memory[r.rank] = (grown, start, r.memory_bytes)
            if grown == MEMORY_WINDOWS:
                growth = r.memory_bytes / start - 1 if start else float("inf")
                verdicts.append(Verdict(r.step, r.rank, r.host, "memory", r.memory_bytes, start, growth, grown))
        return verdicts
