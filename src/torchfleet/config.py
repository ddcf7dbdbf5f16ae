"""Typed configuration, validated once on construction: where processes run (LaunchConfig).

Precedence is one way: the dataclass defaults, then the command line. Every
error names the value and what would be accepted, with the arithmetic shown.
The configs of the commands above the core sit with them (train/config.py,
bench/config.py) and share the rules here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from torchfleet.errors import UsageError

BACKENDS = ("auto", "gloo", "nccl", "mpi")
FAULT_TOLERANCE = ("restart", "step")

T = TypeVar("T")


def option(default: T, help: str, **flag: Any) -> T:
    """A config field that is also a command-line flag, declared once (cli/flags.py derives the flag).

    The flag's name, type, default and switch follow from the field; `flag` adds what
    they cannot (choices, metavar, nargs, const). `%(default)s` in `help` is argparse's
    own expansion of the field's default, so the text cannot fall behind it.
    """
    return field(default=default, metadata={"help": help, **flag})


def at_least(name: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise UsageError(f"{name} {value} must be at least {low}")


def parse_nnodes(value: int | str) -> tuple[int, int]:
    """torchrun's --nnodes: "N" or "MIN:MAX" (elastic) -> (min, max)."""
    text = str(value).strip()
    parts = text.split(":")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        low, high = int(parts[0]), int(parts[-1])
        if 1 <= low <= high:
            return low, high
    raise UsageError(
        f"--nnodes {text!r} is not a number of machines like 2 or a range like 1:4 (MIN:MAX, 1 <= MIN <= MAX)"
    )


def parse_endpoint(value: str, default_port: int, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """ "host:port", "host" or "[v6]:port" -> (host, port)."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port or (host.count(":") and not host.startswith("[")):
        host, port = text, str(default_port)  # no port, or a bare IPv6 address
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"{flag} {value!r} is not HOST:PORT (e.g. 10.0.0.1:{default_port})")
    return host, int(port)


@dataclass
class LaunchConfig:
    """Where processes run: torchrun's own knobs, with torchrun's names."""

    nproc_per_node: int = 1
    nnodes: int | str = 1  # N, or "MIN:MAX" for an elastic job (c10d rendezvous)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one machine: a free port is chosen
    max_restarts: int = 0
    rdzv_endpoint: str | None = None  # HOST[:PORT] of the c10d rendezvous (elastic jobs)
    rdzv_id: str | None = None  # the job's id, the same on every machine (c10d)
    preflight: bool = True  # check the other machines before a multi-machine job
    # "restart" (torchrun's agent restarts the workers, which resume from a checkpoint) or "step"
    # (each machine a replica group under torchft: the others go on when one is lost; replica_groups/).
    fault_tolerance: str = "restart"
    lighthouse: str | None = None  # HOST:PORT of a lighthouse started elsewhere (torchfleet lighthouse)
    join_timeout: float = 120.0  # seconds a replica group waits for the others (or to commit a step)

    def __post_init__(self) -> None:
        self.min_nodes, self.max_nodes = parse_nnodes(self.nnodes)
        self.nnodes = self.max_nodes if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"
        at_least("--nproc-per-node", self.nproc_per_node, 1)
        at_least("--max-restarts", self.max_restarts, 0)
        if not self.elastic and not 0 <= self.node_rank < self.max_nodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes};"
                f" use 0 to {self.max_nodes - 1}"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port; use 1 to 65535")
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint, 29400)
        self._check_fault_tolerance()

    def _check_fault_tolerance(self) -> None:
        if self.fault_tolerance not in FAULT_TOLERANCE:
            raise UsageError(
                f"--fault-tolerance {self.fault_tolerance!r} is not a mode; choose restart (torchrun"
                " restarts the workers from the newest checkpoint) or step (torchft: the other"
                " machines go on at the next step)"
            )
        if self.fault_tolerance == "restart":
            if self.lighthouse is not None:
                raise UsageError(f"--lighthouse {self.lighthouse} applies with --fault-tolerance step")
            return
        if self.elastic:
            raise UsageError(
                f"--fault-tolerance step takes a fixed --nnodes N, not --nnodes {self.nnodes} or"
                " --rdzv-endpoint: each machine is a replica group, and torchft's quorum lets groups"
                " leave and join; drop MIN: and --rdzv-endpoint"
            )
        if self.lighthouse is not None:
            parse_endpoint(self.lighthouse, 29510, "--lighthouse")
        if not self.join_timeout > 0:
            raise UsageError(f"--join-timeout {self.join_timeout} must be a positive number of seconds")

    @property
    def elastic(self) -> bool:
        """A c10d rendezvous (torchrun's --rdzv-endpoint, or --nnodes MIN:MAX)."""
        return self.rdzv_endpoint is not None or self.min_nodes != self.max_nodes

    @property
    def multi_node(self) -> bool:
        return self.elastic or self.max_nodes > 1

    @property
    def endpoint(self) -> tuple[str, int]:
        """(host, port) other machines reach: the c10d endpoint, else the master's."""
        if self.rdzv_endpoint is not None:
            return parse_endpoint(self.rdzv_endpoint, 29400)
        return self.master_addr, self.master_port or 29500

    @property
    def world_size(self) -> int:
        """Processes in all (the largest allowed, for an elastic job)."""
        return self.nproc_per_node * self.max_nodes

    @property
    def multi_process(self) -> bool:
        return self.world_size > 1

    @property
    def replica_groups(self) -> bool:
        """Per-step fault tolerance: each machine's processes are a replica group under torchft."""
        return self.fault_tolerance == "step"
