"""What `torchfleet train` runs, validated once (config.py's rules)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torchfleet.config import BACKENDS, at_least
from torchfleet.errors import UsageError, choice_error
from torchfleet.outputs import check_writable_dir, check_writable_file
from torchfleet.precision import PRECISIONS
from torchfleet.strategies import STRATEGY_NAMES
from torchfleet.train.datasets import DATASETS, TOKEN_DATASETS
from torchfleet.train.metrics import check_metrics_out, check_tensorboard
from torchfleet.train.models import GPT_PRESETS, MODELS, TOKEN_MODELS

OPTIMIZERS = ("sgd", "adamw")


@dataclass
class TrainConfig:
    """Everything `torchfleet train` needs to run one job."""

    strategy: str = "auto"
    model: str = "cnn"
    data: str | None = None  # None: the model's own, text for gpt and digits for the others
    gpt_preset: str = "tiny"  # --model gpt's size (torchfleet.models.GPT_PRESETS)
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
    log_every: int = 10  # steps between host reads of the loss (each waits for the GPU)
    metrics_out: str | None = None  # .csv or .jsonl: a row per logged step and per epoch
    tensorboard: str | None = None  # a directory for TensorBoard's event files
    progress: bool = True
    max_grad_norm: float | None = None
    activation_checkpointing: bool = False
    compile: bool | str = False  # "blocks" or "model" (True: blocks)
    strategy_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy != "auto" and self.strategy not in STRATEGY_NAMES:
            raise choice_error("strategy", self.strategy, ("auto", *STRATEGY_NAMES))
        if self.model not in MODELS:
            raise choice_error("model", self.model, MODELS)
        if self.data is None:
            self.data = "text" if self.model in TOKEN_MODELS else "digits"
        if self.data not in DATASETS:
            raise choice_error("data set", self.data, DATASETS)
        if self.model in TOKEN_MODELS and self.data not in TOKEN_DATASETS:
            raise UsageError(f"--model {self.model} reads token sequences but --data {self.data} holds images;"
                             f" use --data {TOKEN_DATASETS[0]} (its default) or leave --data out")
        if self.data in TOKEN_DATASETS and self.model not in TOKEN_MODELS:
            raise UsageError(f"--data {self.data} holds token sequences for --model {' or '.join(TOKEN_MODELS)},"
                             f" but --model {self.model} classifies images; use --data digits or synthetic")
        if self.gpt_preset not in GPT_PRESETS:
            raise choice_error("--gpt-preset", self.gpt_preset, tuple(GPT_PRESETS))
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
        at_least("--log-every", self.log_every, 1)
        if self.metrics_out:
            check_metrics_out(self.metrics_out)
        if not self.hang_timeout >= 0:
            raise UsageError(f"--hang-timeout {self.hang_timeout} must be 0 (off) or a positive number of seconds")
        if self.max_steps is not None:
            at_least("--max-steps", self.max_steps, 1)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise UsageError(f"--max-grad-norm {self.max_grad_norm} must be a positive number")
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
        if self.metrics_out:
            check_writable_file(self.metrics_out, "--metrics-out")
        if self.tensorboard:
            check_tensorboard()
            check_writable_dir(self.tensorboard, "--tensorboard")

    def to_dict(self) -> dict:
        return asdict(self)
