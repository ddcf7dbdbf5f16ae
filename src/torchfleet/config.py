"""Typed configuration, validated once on construction.

Precedence is one way: the dataclass defaults, then the command line. Every
error names the value and what would be accepted, with the arithmetic shown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torchfleet.data import DATASETS
from torchfleet.errors import UsageError, choice_error
from torchfleet.models import MODELS
from torchfleet.outputs import check_writable_dir, check_writable_file
from torchfleet.precision import PRECISIONS

OPTIMIZERS = ("sgd", "adamw")
BACKENDS = ("auto", "gloo", "nccl", "mpi")


def _at_least(name: str, value: int | float, low: int | float) -> None:
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
    raise UsageError(f"--nnodes {text!r} is not a number of machines like 2 or a range like 1:4"
                     " (MIN:MAX, 1 <= MIN <= MAX)")


def parse_endpoint(value: str, default_port: int) -> tuple[str, int]:
    """"host:port", "host" or "[v6]:port" -> (host, port)."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port or (host.count(":") and not host.startswith("[")):
        host, port = text, str(default_port)  # no port, or a bare IPv6 address
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-endpoint {value!r} is not HOST:PORT (e.g. 10.0.0.1:29400)")
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

    def __post_init__(self) -> None:
        self.min_nodes, self.max_nodes = parse_nnodes(self.nnodes)
        self.nnodes = self.max_nodes if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"
        _at_least("--nproc-per-node", self.nproc_per_node, 1)
        _at_least("--max-restarts", self.max_restarts, 0)
        if not self.elastic and not 0 <= self.node_rank < self.max_nodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes};"
                f" use 0 to {self.max_nodes - 1}"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port; use 1 to 65535")
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint, 29400)

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


@dataclass
class BenchConfig:
    """What `torchfleet bench` measures. Empty tuples mean "choose for this machine"
    (bench.plan does, from doctor's availability and the hardware)."""

    model: str = "cnn"
    strategies: tuple[str, ...] = ()
    nproc: tuple[int, ...] = ()  # process counts for multi-process strategies
    batch_sizes: tuple[int, ...] = ()  # global
    precisions: tuple[str, ...] = ()
    warmup: int = 5
    steps: int = 30
    threads: int | None = None  # intra-op threads per process; None: usable cores / processes
    out: str = "runs/bench"
    seed: int = 0
    strategy_options: dict = field(default_factory=dict)
    cell_timeout_s: float = 1800.0  # a cell still running then is killed and reported

    def __post_init__(self) -> None:
        from torchfleet.strategies import STRATEGY_NAMES

        if self.model not in MODELS:
            raise choice_error("model", self.model, MODELS)
        for name in self.strategies:
            if name not in STRATEGY_NAMES:
                raise choice_error("strategy", name, STRATEGY_NAMES)
        for name in self.precisions:
            if name not in PRECISIONS:
                raise choice_error("precision", name, PRECISIONS)
        for n in self.nproc:
            _at_least("--nproc", n, 1)
        for b in self.batch_sizes:
            _at_least("--batch-sizes", b, 1)
        _at_least("--warmup", self.warmup, 0)
        _at_least("--steps", self.steps, 2)  # a spread needs two steps
        if self.threads is not None:
            _at_least("--threads", self.threads, 1)
        if not self.cell_timeout_s > 0:
            raise UsageError(f"cell timeout {self.cell_timeout_s} must be a positive number of seconds")


@dataclass
class TrainConfig:
    """Everything `torchfleet train` needs to run one job."""

    strategy: str = "auto"
    model: str = "cnn"
    data: str = "digits"
    epochs: int = 8
    batch_size: int = 64  # global: shared by all processes
    lr: float = 2e-3
    optimizer: str = "adamw"
    seed: int = 0
    precision: str = "fp32"
    backend: str = "auto"
    grad_accum: int = 1
    max_steps: int | None = None  # stop early after this many optimizer steps
    synthetic_size: int = 4096
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # optimizer steps; 0 saves only at the end of each epoch
    resume: bool = False
    resume_fallback: bool = False  # a damaged newest checkpoint: step back instead of stopping
    keep_checkpoints: int = 3
    hang_timeout: float = 300.0  # seconds without progress on any rank before the watchdog's verdict; 0: off
    json_out: str | None = None
    progress: bool = True
    strategy_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from torchfleet.strategies import STRATEGY_NAMES  # the registry imports torch

        if self.strategy != "auto" and self.strategy not in STRATEGY_NAMES:
            raise choice_error("strategy", self.strategy, ("auto", *STRATEGY_NAMES))
        if self.model not in MODELS:
            raise choice_error("model", self.model, MODELS)
        if self.data not in DATASETS:
            raise choice_error("data set", self.data, DATASETS)
        if self.precision not in PRECISIONS:
            raise choice_error("precision", self.precision, PRECISIONS)
        if self.optimizer not in OPTIMIZERS:
            raise choice_error("optimizer", self.optimizer, OPTIMIZERS)
        if self.backend not in BACKENDS:
            raise choice_error("backend", self.backend, BACKENDS)
        _at_least("--epochs", self.epochs, 1)
        _at_least("--batch-size", self.batch_size, 1)
        _at_least("--grad-accum", self.grad_accum, 1)
        _at_least("--checkpoint-every", self.checkpoint_every, 0)
        _at_least("--synthetic-size", self.synthetic_size, 1)
        _at_least("--keep-checkpoints", self.keep_checkpoints, 1)
        if not self.hang_timeout >= 0:
            raise UsageError(f"--hang-timeout {self.hang_timeout} must be 0 (off) or a positive number of seconds")
        if self.max_steps is not None:
            _at_least("--max-steps", self.max_steps, 1)
        if not self.lr > 0:
            raise UsageError(f"--lr {self.lr} must be a positive number")
        if (self.resume or self.resume_fallback) and not self.checkpoint_dir:
            flag = "--resume" if self.resume else "--resume-fallback"
            raise UsageError(f"{flag} needs --checkpoint-dir to say where the checkpoints are")

    def check_outputs(self) -> None:
        """Refuse an output path that cannot be written, before any work is done."""
        if self.checkpoint_dir:
            check_writable_dir(self.checkpoint_dir, "--checkpoint-dir")
        if self.json_out:
            check_writable_file(self.json_out, "--json-out")

    def to_dict(self) -> dict:
        return asdict(self)
