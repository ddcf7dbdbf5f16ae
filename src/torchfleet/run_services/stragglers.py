"""Straggler verdicts: which rank keeps the others waiting, on which host, by how much, in which phase.

The main rank judges each log window's records (run_services/rank_figures.py). A
rank is slow in a phase when its seconds per step there exceed the median of
the other ranks' by more than a threshold and by more than FLOOR_S (noise on a
busy machine); it is named once it has been slow in that phase for WINDOWS log
windows in a row, and again only after a window without.

The threshold is the run's own: its standing in a phase is log(mine / the
others' median) (FLOOR_S added to both, so phases of a few microseconds do not
swing it), and the run's noise there is the median change of the ranks'
standings from one window to the next, over the last HISTORY windows. A rank
is slow when its standing exceeds NOISE_K times that noise, and log(1 + SLOWER)
whatever the noise. Two ranks pinned each to its own core of an idle 2-core
machine, training gpt, differed by 20-40% from window to window, one way or the
other: with a fixed 20% both were named in turn in a 27 s run. A rank slowed
for good keeps its standing, so its changes, and the noise, stay small. The
windows that hold any of the first WARMUP_STEPS steps are not judged (allocator
growth, the first graphs, Gloo's first connections: a 36-step run once named
rank 0 at step 10, 42% above the other).

In a synchronous job every rank's step ends together: the ranks that wait
for a slow one show the wait as communication, and a rank whose core others
took runs its collectives slower too. So the phase named is where the time is
lost: communication is judged only in windows where no rank stands above the
others in data or compute even by half the margin, and its streaks start
again after any window that is not judged. A slow link out of one host
slows every rank's gradient sync alike (a ring all-reduce waits for its
slowest hop), so no rank stands out here: train/link_probe.py sees every
rank's communication rise together, probes each rank's link, and names the
rank whose link sends slowly (a Verdict with `send_mb_s`).

A busy machine is not a rank's fault. A window is busy when other processes
kept busy_cores() of a host's cores busy (rank_figures' others_cores), or when
every rank's main thread waited for a CPU for BUSY_WAIT of its step or more
(cpu_wait_s: this job's own threads may outnumber the cores). After WINDOWS
busy windows in a row a MachineBusy note says so, with the figures, once per
such streak. In a busy window communication is not judged (a rank's sync waits
for peers others' processes held up), and a rank is slow only above BUSY_SLOWER
(twice the others' median): the scheduler shares the cores unevenly, and for a few
windows at a time puts other processes on one rank's core (unpinned ranks
beside another job's busy core: one named at 82% above, for 3 windows, in 2
runs of 5 with a 20% margin); a rank slowed by its own work, or whose own core
others hold for good, stays far above (a 30 ms sleep in one of four ranks'
fsdp steps: 35 ms of compute against 4 to 13 ms; a core shared with two busy
processes: about 3 times).

Memory is judged the same way: a rank whose memory rose by more than
GROWTH_FLOOR bytes in each of MEMORY_WINDOWS windows in a row is named.
A replica group leaving or joining the quorum is named as it happens.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics

from torchfleet.machine_load import busy_cores
from torchfleet.view import record as rank_record
from torchfleet.view.record import RankWindow

SLOWER = 0.5
NOISE_K = 2.0
HISTORY = 8
FLOOR_S = 0.005
WINDOWS = 3
WARMUP_STEPS = 5
BUSY_WAIT = 0.1
BUSY_SLOWER = 1.0
MEMORY_WINDOWS = 5
GROWTH_FLOOR = 4 << 20
PHASES = rank_record.phases()  # phase name: the record's field (data, compute, communication)


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
    cpu_wait_s: float | None = None  # seconds per step its main thread waited for a CPU (data, compute)
    others_wait_s: float | None = None  # the other ranks' median of the same

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
        text = (
            f"straggler: {where} is slow in {self.phase}: {self.value * 1e3:.1f} ms a step, {how} the other"
            f" ranks' median of {self.median * 1e3:.1f} ms, for {self.windows} log windows up to step {self.step}"
        )
        if self.cpu_wait_s is not None and self.others_wait_s is not None:
            if self.cpu_wait_s - self.others_wait_s > FLOOR_S:
                text += (
                    f"; it waited {self.cpu_wait_s * 1e3:.1f} ms a step for a CPU, the others"
                    f" {self.others_wait_s * 1e3:.1f} ms: other processes share its cores"
                )
        return text

    def row(self) -> dict:
        return {**dataclasses.asdict(self), "message": self.line()}


def slow_ranks(records: list[RankWindow], field: str, slower: float = SLOWER) -> set[int]:
    """The ranks above the other ranks' median in `field` this window by `slower` and by FLOOR_S."""
    slow = set()
    for record in records:
        others = statistics.median(getattr(r, field) for r in records if r is not record)
        mine = getattr(record, field)
        if mine > others * (1 + slower) and mine - others > FLOOR_S:
            slow.add(record.rank)
    return slow


def standings(records: list[RankWindow], field: str) -> dict[int, float]:
    """Each rank's log(mine / the other ranks' median) in `field`, FLOOR_S added to both."""
    found = {}
    for record in records:
        others = statistics.median(getattr(r, field) for r in records if r is not record)
        found[record.rank] = math.log((getattr(record, field) + FLOOR_S) / (others + FLOOR_S))
    return found


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclasses.dataclass(frozen=True)
class MachineBusy:
    """The machine was busy for WINDOWS windows up to `step`: a metrics row of kind "machine", and `line`."""

    step: int
    windows: int
    wait_low: float | None  # the least and most share of a step a rank waited for a CPU (None: not every rank)
    wait_high: float | None
    others_cores: float | None  # other processes' cores on the busiest host
    host_cores: int

    def line(self) -> str:
        span = f"for {self.windows} log windows up to step {self.step}"
        waited = (
            f"every rank waited for a CPU {self.wait_low:.0%} to {self.wait_high:.0%} of its step"
            if self.wait_low is not None and self.wait_high is not None
            else ""
        )
        if self.others_cores is not None and self.others_cores >= busy_cores(self.host_cores):
            return (
                f"the machine is busy: other processes kept {self.others_cores:.1f} of its {self.host_cores} cores"
                f" busy{' and ' + waited if waited else ''}, {span}; step times here are partly theirs, and a rank"
                " is named slow only at twice the others' time"
            )
        others = "" if self.others_cores is None else f" (other processes kept {self.others_cores:.1f} busy)"
        return (
            f"the machine is busy with this job: {waited}, {span}: its processes and threads outnumber the"
            f" {self.host_cores} cores{others}; fewer processes or --threads would wait less"
        )

    def row(self) -> dict:
        return {**dataclasses.asdict(self), "message": self.line()}


class StragglerWatch:
    """The verdicts over a run's windows: streaks per rank and phase, each named once until it recovers."""

    def __init__(self) -> None:
        self._streaks: dict[tuple[int, str], int] = {}
        self._calm: dict[tuple[int, str], int] = {}  # windows in a row a rank was not slow in a phase
        self._named: set[tuple[int, str]] = set()  # named, and not yet back at the others' pace
        self._memory: dict[int, tuple[int, float, float]] = {}  # rank: (windows grown, bytes at start, last)
        self._participants: int | None = None
        self._history: dict[str, list[dict[int, float]]] = {phase: [] for phase in PHASES}  # standings by window
        self._busy = 0  # windows in a row every rank waited for a CPU
        self.machine: list[MachineBusy] = []  # notes of this window (`judge` fills it)

    def judge(self, records: list[RankWindow]) -> list[Verdict]:
        """The verdicts that this window's records complete (most windows: none); `machine` the busy note."""
        self.machine = []
        warm = records and records[0].step - records[0].steps < WARMUP_STEPS
        if len(records) < 2 or not all(r.steps for r in records) or warm:
            return self._memory_verdicts(records)
        # On a busy machine a rank must be twice the others' to be slow for its own part, and a slow gradient sync
        # is the scheduler's: the ranks wait for peers that others' processes held up, at random.
        busy = self._machine_busy(records)
        floor = math.log1p(BUSY_SLOWER if busy else SLOWER)
        verdicts, leaning = [], False
        for phase, field in PHASES.items():
            standing = standings(records, field)
            history = self._history[phase]
            history.append(standing)
            del history[:-HISTORY]
            if phase == "communication" and (leaning or busy):
                # the others waited for a rank slow in data or compute: their wait is not their own slowness
                self._streaks.update({(r.rank, phase): 0 for r in records})
                continue
            margin = max(floor, NOISE_K * _noise(history))
            now = {r for r in slow_ranks(records, field, 0.0) if standing[r] > margin}
            leaning = leaning or any(x > margin / 2 for x in standing.values())
            for record in records:
                key = (record.rank, phase)
                slow = record.rank in now
                self._streaks[key] = self._streaks.get(key, 0) + 1 if slow else 0
                self._calm[key] = 0 if slow else self._calm.get(key, 0) + 1
                # Named again only after WINDOWS windows in a row at the others' pace: one window under the
                # margin on a busy machine is noise, not a recovery (a rank slowed for good was named twice).
                if key in self._named and self._calm[key] >= WINDOWS:
                    self._named.discard(key)
                if self._streaks[key] >= WINDOWS and key not in self._named:
                    self._named.add(key)
                    verdicts.append(self._verdict(record, records, phase, field))
        return verdicts + self._memory_verdicts(records)

    def _verdict(self, record: RankWindow, records: list[RankWindow], phase: str, field: str) -> Verdict:
        others = [r for r in records if r is not record]
        mine, median = getattr(record, field), statistics.median(getattr(r, field) for r in others)
        slower = mine / median - 1 if median > 0 else float("inf")
        waits = [r.cpu_wait_s for r in others if r.cpu_wait_s is not None]
        wait = record.cpu_wait_s if phase != "communication" and waits else None
        others_wait = statistics.median(waits) if wait is not None else None
        return Verdict(
            record.step, record.rank, record.host, phase, mine, median, slower, WINDOWS, None, None, wait, others_wait
        )

    def _machine_busy(self, records: list[RankWindow]) -> bool:
        """Whether other processes held busy_cores() of a host, or every rank waited for a CPU for BUSY_WAIT of
        its step; a note at WINDOWS such windows in a row."""
        # At most the whole step: a window's wait also covers what runs between steps (an evaluation, the read).
        shares = [min(1.0, r.cpu_wait_s / r.step_s) for r in records if r.cpu_wait_s is not None and r.step_s > 0]
        waiting = len(shares) == len(records) and min(shares) >= BUSY_WAIT
        others = any(r.others_cores is not None and r.others_cores >= busy_cores(r.host_cores) for r in records)
        if not (waiting or others):
            self._busy = 0
            return False
        self._busy += 1
        if self._busy == WINDOWS:
            busiest = max(records, key=lambda r: r.others_cores or 0.0)
            low, high = (min(shares), max(shares)) if waiting else (None, None)
            self.machine = [MachineBusy(records[0].step, WINDOWS, low, high, busiest.others_cores, busiest.host_cores)]
        return True

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


def _noise(history: list[dict[int, float]]) -> float:
    """The median change of a rank's standing from one window to the next, over `history` (0 with one window)."""
    changes = [abs(now[r] - before[r]) for before, now in itertools.pairwise(history) for r in now if r in before]
    return statistics.median(changes) if changes else 0.0
