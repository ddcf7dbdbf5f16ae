"""What `torchfleet train` runs, validated once (config.py's rules)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torchfleet.config import BACKENDS, at_least
from torchfleet.errors import UsageError, choice_error
from torchfleet.outputs import check_writable_dir, check_writable_file
from torchfleet.precision import PRECISIONS
from torchfleet.strategies import STRATEGY_NAMES
from torchfleet.train.datasets import DATASETS
from torchfleet.train.models import MODELS

OPTIMIZERS = ("sgd", "adamw")


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
        at_least("--epochs", self.epochs, 1)
        at_least("--batch-size", self.batch_size, 1)
        at_least("--grad-accum", self.grad_accum, 1)
        at_least("--checkpoint-every", self.checkpoint_every, 0)
        at_least("--synthetic-size", self.synthetic_size, 1)
        at_least("--keep-checkpoints", self.keep_checkpoints, 1)
        if not self.hang_timeout >= 0:
            raise UsageError(f"--hang-timeout {self.hang_timeout} must be 0 (off) or a positive number of seconds")
        if self.max_steps is not None:
            at_least("--max-steps", self.max_steps, 1)
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
