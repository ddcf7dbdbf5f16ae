"""Who is in each quorum, who healed from whom, and how long the others paused: the lines a run prints.

torchft's Manager keeps the quorum it got to itself, but hands it to two
objects torchfleet gives it: the process group joining the groups is
reconfigured with every new quorum (`configure`, with each member's global
rank, whose quotient by the group's size is its group index, from the digits
torchft reads off the replica id "group<N>"), and the checkpoint transport is
told whom it sends the state to and whom it takes it from (replica ranks: the
positions in that same member list). Subclasses of both record what they
were told; `Account` turns it into sentences.
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections import deque

from torchft.checkpointing.pg_transport import PGTransport
from torchft.process_group import ProcessGroup


def recording(base: type) -> type:
    """`base` (torchft's ProcessGroupGloo or ProcessGroupNCCL), remembering the groups of each quorum."""
    signature = inspect.signature(ProcessGroup.configure)

    class Recorded(base):  # type: ignore[valid-type, misc]
        members: tuple[int, ...] = ()  # group indices, in replica-rank order
        quorum_id: int | None = None  # torchft's: a new one whenever a member leaves, joins or is replaced

        def configure(self, *args, **kwargs) -> None:
            given = signature.bind(self, *args, **kwargs).arguments
            super().configure(*args, **kwargs)
            size = given.get("group_world_size") or 1
            self.members = tuple(rank // size for rank in given.get("global_ranks") or ())
            self.quorum_id = given.get("quorum_id")

    Recorded.__name__ = Recorded.__qualname__ = f"Recorded{base.__name__}"
    return Recorded


class RecordedTransport(PGTransport):
    """torchft's transport over the groups' process group, noting each transfer (from the quorum thread)."""

    received: tuple[int, int, float] | None = None  # (source replica rank, step, seconds): this group healed
    sent: list[tuple[list[int], int]]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = []

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)
        self.sent.append((list(dst_ranks), step))

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        start = time.monotonic()
        state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.received = (src_rank, step, time.monotonic() - start)
        return state


def _names(groups) -> str:
    groups = sorted(groups)
    return "group " + str(groups[0]) if len(groups) == 1 else "groups " + ", ".join(map(str, groups))


class Account:
    """Sentences about groups that left, joined and healed, made at each committed step."""

    def __init__(self, group: int, groups: int):
        self.group, self.groups = group, groups
        self.members: tuple[int, ...] = ()
        self.quorum_id: int | None = None
        self._last_commit: float | None = None
        self._intervals: deque[float] = deque(maxlen=25)  # recent seconds between commits
        self.pauses: list[float] = []  # seconds lost at each membership change, for reports

    def committed(
        self, step: int, members: tuple[int, ...], transport: RecordedTransport, quorum_id: int | None = None
    ) -> list[str]:
        """Lines for a step that committed as `step` (the count after it) with `members` in torchft's quorum
        `quorum_id`."""
        now = time.monotonic()
        lines: list[str] = []
        interval = None if self._last_commit is None else now - self._last_commit
        self._last_commit = now
        before, self.members = self.members, members
        changed, self.quorum_id = quorum_id != self.quorum_id and self.quorum_id is not None, quorum_id
        healed, transport.received = transport.received, None
        sent, transport.sent = transport.sent, []
        if healed is not None:
            source, at, seconds = healed
            peer = members[source] if source < len(members) else source
            lines.append(
                f"group {self.group} healed from group {peer} at step {at}: took its weights in"
                f" {seconds:.1f} s, and goes on with {_names(members)}"
            )
        elif before:
            left, joined = set(before) - set(members), set(members) - set(before)
            receivers = {members[rank] for ranks, _ in sent for rank in ranks if rank < len(members)}
            # What the membership change cost: the gap between commits beyond a usual step.
            usual = statistics.median(self._intervals) if self._intervals else 0.0
            pause = max(0.0, (interval or 0.0) - usual)
            if left:
                self.pauses.append(pause)
                lines.append(
                    f"{_names(left)} left at step {step - 1}: {_names(members)} went on after a pause"
                    f" of {pause:.1f} s ({len(members)} of {self.groups} groups)"
                )
            if joined:
                by = f" and healed from this group ({self.group})" if receivers & joined else ""
                lines.append(f"{_names(joined)} joined at step {step - 1}{by} ({len(members)} of {self.groups} groups)")
            if changed and not left and not joined:
                # The same groups in a new quorum: one was lost and started again before the lighthouse
                # gave up on it (its agent's --max-restarts), so it left and joined at once.
                self.pauses.append(pause)
                who = _names(receivers) if receivers else "a group"
                healing = f", healing from this group ({self.group})" if receivers else ""
                lines.append(
                    f"{who} was lost and started again at step {step - 1}{healing}; {_names(members)}"
                    f" went on after a pause of {pause:.1f} s"
                )
        if interval is not None and healed is None and before == members and not changed:
            self._intervals.append(interval)
        return lines
