"""Which replica group this process belongs to, under per-step fault tolerance.

`torchfleet run --fault-tolerance step` (and `train`) makes each machine a
replica group: its processes train together as any strategy does, and
torchft's Manager averages their gradients with the other groups' every step,
through a quorum the lighthouse forms. The launcher tells the workers where
they stand in these variables, read once by `ReplicaEnv.detect()`:

    TORCHFT_LIGHTHOUSE            the lighthouse's URL (torchft's own name)
    TORCHFLEET_REPLICA_GROUP      this group's index, 0 to groups-1
    TORCHFLEET_REPLICA_GROUPS     how many groups the job has
    TORCHFLEET_REPLICA_ADDR       the address the other groups reach this machine at
    TORCHFLEET_JOIN_TIMEOUT       seconds a group waits for the others at the start

A job script written by `torchfleet slurm` or `torchfleet k8s` sets them too.
No torch here: this module is imported by the launcher's parent as well.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from torchfleet.config import FAULT_TOLERANCE
from torchfleet.env.variables import EnvError
from torchfleet.errors import UsageError, choice_error

LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
GROUP = "TORCHFLEET_REPLICA_GROUP"
GROUPS = "TORCHFLEET_REPLICA_GROUPS"
ADDR = "TORCHFLEET_REPLICA_ADDR"
JOIN_TIMEOUT = "TORCHFLEET_JOIN_TIMEOUT"
DEFAULT_JOIN_TIMEOUT = 120.0


@dataclass(frozen=True)
class ReplicaEnv:
    lighthouse: str  # http://host:port
    group: int
    groups: int
    addr: str  # this machine's address as the other groups reach it
    join_timeout: float = DEFAULT_JOIN_TIMEOUT

    def __post_init__(self) -> None:
        if not 1 <= self.groups:
            raise EnvError(f"{GROUPS}={self.groups} must be at least 1")
        if not 0 <= self.group < self.groups:
            raise EnvError(f"{GROUP}={self.group} is out of range for {GROUPS}={self.groups}")
        if not self.lighthouse.startswith(("http://", "https://")):
            raise EnvError(f"{LIGHTHOUSE}={self.lighthouse!r} is not a URL like http://10.0.0.1:29510")
        if not self.join_timeout > 0:
            raise EnvError(f"{JOIN_TIMEOUT}={self.join_timeout} must be a positive number of seconds")

    @property
    def replica_id(self) -> str:
        """torchft's replica id: its trailing digits are the group index, which torchft reads back."""
        return f"group{self.group}"

    def variables(self) -> dict[str, str]:
        """The variables that describe this environment, for a launcher to hand its workers."""
        return {
            LIGHTHOUSE: self.lighthouse,
            GROUP: str(self.group),
            GROUPS: str(self.groups),
            ADDR: self.addr,
            JOIN_TIMEOUT: f"{self.join_timeout:g}",
        }

    @classmethod
    def for_fleet(cls, fault_tolerance: str | None) -> ReplicaEnv | None:
        """The replica group this process is in under --fault-tolerance step, or None; refuses a mode that
        contradicts what the launcher set up."""
        found = cls.detect()
        if fault_tolerance is not None and fault_tolerance not in FAULT_TOLERANCE:
            raise choice_error("fault_tolerance", fault_tolerance, FAULT_TOLERANCE)
        if fault_tolerance == "step" and found is None:
            raise UsageError(
                "fault_tolerance='step' needs replica groups: launch the script with torchfleet run"
                " --fault-tolerance step --nnodes N --node-rank R --master-addr A (it starts torchft's"
                " lighthouse and one group per machine)"
            )
        if fault_tolerance == "restart" and found is not None:
            raise UsageError(
                f"this process was started as replica group {found.group} of {found.groups}"
                " (--fault-tolerance step) but Fleet was given fault_tolerance='restart'; leave it out"
            )
        return found

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> ReplicaEnv | None:
        """The replica group this process is in, or None when no launcher made one."""
        environ = os.environ if environ is None else environ
        if GROUP not in environ:
            return None
        missing = [name for name in (LIGHTHOUSE, GROUPS, ADDR) if not environ.get(name)]
        if missing:
            raise EnvError(
                f"{GROUP} is set but {', '.join(missing)} is not: a replica group needs"
                f" {LIGHTHOUSE}, {GROUPS} and {ADDR} as well"
            )
        try:
            return cls(
                lighthouse=environ[LIGHTHOUSE],
                group=int(environ[GROUP]),
                groups=int(environ[GROUPS]),
                addr=environ[ADDR],
                join_timeout=float(environ.get(JOIN_TIMEOUT) or DEFAULT_JOIN_TIMEOUT),
            )
        except ValueError as exc:
            if isinstance(exc, EnvError):
                raise
            raise EnvError(f"{GROUP}, {GROUPS} and {JOIN_TIMEOUT} must be numbers ({exc})") from None
