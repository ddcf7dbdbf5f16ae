"""Typed configuration, validated once on construction.

Precedence is one way: the dataclass defaults, then the command line. Every
error names the value and what would be accepted, with the arithmetic shown.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchfleet.data import DATASETS
from torchfleet.errors import UsageError, choice_error
from torchfleet.models import MODELS
from torchfleet.precision import PRECISIONS

OPTIMIZERS = ("sgd", "adamw")
BACKENDS = ("auto", "gloo", "nccl", "mpi")


def _at_least(name: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise UsageError(f"{name} {value} must be at least {low}")


def check_writable_dir(path: str | os.PathLike, what: str = "checkpoint directory") -> Path:
    """Create `path` if needed and prove it takes files, before any work is done."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".torchfleet-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"{what} {str(path)!r} is not writable ({reason}); choose a directory you can write to") from None
    return path


@dataclass
class LaunchConfig:
    """Where processes run: torchrun's own knobs, with torchrun's names."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one machine: a free port is chosen
    max_restarts: int = 0

    def __post_init__(self) -> None:
        _at_least("--nproc-per-node", self.nproc_per_node, 1)
        _at_least("--nnodes", self.nnodes, 1)
        _at_least("--max-restarts", self.max_restarts, 0)
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes};"
                f" use 0 to {self.nnodes - 1}"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port; use 1 to 65535")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

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
        if self.max_steps is not None:
            _at_least("--max-steps", self.max_steps, 1)
        if not self.lr > 0:
            raise UsageError(f"--lr {self.lr} must be a positive number")
        if self.resume and not self.checkpoint_dir:
            raise UsageError("--resume needs --checkpoint-dir to say where the checkpoints are")

    def to_dict(self) -> dict:
        return asdict(self)
