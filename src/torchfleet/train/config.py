"""What `torchfleet train` runs, validated once (config.py's rules)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchfleet.config import BACKENDS, at_least, option
from torchfleet.errors import UsageError, choice_error
from torchfleet.launcher.preempt_relay import parse_signals
from torchfleet.models.user import is_user_model, user_function
from torchfleet.outputs import check_writable_dir, check_writable_file
from torchfleet.precision import PRECISIONS
from torchfleet.run_services.metrics import check_metrics_out, check_tensorboard
from torchfleet.strategies import registry
from torchfleet.train.datasets import DATASETS, DOCUMENTS, SHARDS, TOKEN_DATASETS, path_kind
from torchfleet.train.models import GPT_PRESETS, MODELS, TOKEN_MODELS
from torchfleet.train.own_model import check_hf_model
from torchfleet.worker.spot_notices import check_spec

OPTIMIZERS = ("sgd", "adamw")
RESUME_AUTO = "auto"  # --resume auto


@dataclass
class TrainConfig:
    """Everything `torchfleet train` needs to run one job.

    Each `option` field is also its `train` flag (--batch-size for batch_size), with
    the help text written here: adding a field adds the flag (cli/flags.py). The
    fields' order is the order of `train --help`.
    """

    # No argparse choices: the check below refuses an unknown strategy naming every one, in torchfleet's words.
    strategy: str = option(
        "auto",
        f"{', '.join(registry.names())} (doctor says which run here), or auto: ddp on"
        " 2+ GPUs, serial on one GPU, ddp on 2+ CPU cores without a GPU, else serial (default"
        " %(default)s)",
    )
    model: str = option(
        "cnn",
        "built-in model (default %(default)s): mlp, cnn, transformer classify digits; gpt is"
        " a decoder-only transformer (--gpt-preset), gpt-moe the same with each MLP a mixture of 8"
        " experts, top-2; resnet18, resnet50 are torchvision's ResNets, built in (torchvision not needed);"
        " or MODULE:FUNCTION, your function returning a language model (logits over bytes), built on the"
        " meta device and trained on --data text",
        metavar="NAME",
    )
    hf_model: str | None = option(
        None,
        "a Hugging Face causal language model's directory (config.json and safetensors): built on the meta"
        " device, each process reading its share of the weights, and trained on --data text (needs"
        " torchfleet[hf]); --save-model DIR writes it back as a Hugging Face directory",
        metavar="DIR",
    )
    data: str | None = option(
        None,
        f"built-in data ({', '.join(DATASETS)}; default: text for gpt, a byte-level corpus from scikit-learn's"
        " data-set descriptions; digits for the others), or for gpt a PATH: a directory of token shards"
        " (nanoGPT's uint16 .bin, numpy's .npy; files named val* are the validation set), or JSONL or parquet"
        ' documents (a "text" field) with --tokenizer',
        metavar="NAME|PATH",
    )
    tokenizer: str | None = option(
        None,
        "with --data FILE.jsonl or .parquet: a local tokenizer directory (tokenizer.json, or what"
        " transformers' AutoTokenizer reads), run in the loader's worker",
        metavar="DIR",
    )
    gpt_preset: str = option(
        "tiny",
        "--model gpt's and gpt-moe's size (default %(default)s): tiny (237K parameters, CPU),"
        " small50m (57M), gpt2 (124M, GPT-2 small, for GPUs)",
        choices=tuple(GPT_PRESETS),
    )
    epochs: int = option(8, "default %(default)s")
    batch_size: int = option(64, "GLOBAL batch, shared by all processes (default %(default)s)")
    lr: float = option(2e-3, "learning rate (default %(default)s)")
    optimizer: str = option("adamw", "default %(default)s", choices=OPTIMIZERS)
    seed: int = option(0, "default %(default)s")
    precision: str = option("fp32", "default %(default)s", choices=PRECISIONS)
    backend: str = option(
        "auto", "process-group backend (default %(default)s: nccl for GPUs, gloo for CPUs)", choices=BACKENDS
    )
    grad_accum: int = option(
        1, "split each batch into this many micro-steps, syncing gradients once (default %(default)s)"
    )
    max_steps: int | None = option(None, "stop after this many optimizer steps")
    synthetic_size: int = option(4096, "samples in --data synthetic (default %(default)s)")
    checkpoint_dir: str | None = option(None, "save checkpoints here")
    checkpoint_every: int = option(0, "save every N steps (default %(default)s: at the end of each epoch)")
    # --resume alone is True; --resume auto is "auto" (what the written Slurm and Kubernetes jobs pass).
    resume: bool | str = option(
        False,
        "continue from the newest checkpoint in --checkpoint-dir, or start from the"
        " beginning with a note when there is none; --resume auto is the same, the"
        " spelling the written Slurm and Kubernetes jobs use",
        nargs="?",
        const=True,
        metavar="auto",
    )
    resume_fallback: bool = option(
        False, "like --resume, but step back to the previous intact checkpoint when the newest is damaged"
    )
    preempt_signals: str = option(
        "TERM,USR1",
        "with --checkpoint-dir: on these signals every rank finishes its"
        " step, one checkpoint is saved and the job exits with status 75 (preempted,"
        " checkpointed; resume with --resume); comma-separated, or none (default"
        " %(default)s)",
        metavar="SIGNALS",
    )
    preempt_notice: str = option(
        "none",
        "with --checkpoint-dir: also leave so on a spot instance's notice, polled"
        " every 5 s by one process per machine: aws, gcp, azure, or an http:// URL whose"
        " answer 200 with a body is the notice (default %(default)s)",
        metavar="SOURCE",
    )
    keep_checkpoints: int = option(3, "keep the newest K checkpoints (default %(default)s)")
    hang_timeout: float = option(
        300.0,
        "no progress on any rank for this long: print every rank's stack and stop"
        " (default %(default).0f; 0 turns the watchdog off)",
        metavar="SECONDS",
    )
    json_out: str | None = option(None, "write the final figures as JSON", metavar="FILE")
    save_model: str | None = option(
        None,
        "write the final weights to FILE (the model's state dict, for"
        " torch.load); under --fault-tolerance step each replica group writes its own",
        metavar="FILE",
    )
    log_every: int = option(
        10,
        "read the loss on the host every N steps (default %(default)s): each read waits"
        " for the GPU, so the steps between run without a pause; every step's loss is checked",
        metavar="N",
    )
    metrics_out: str | None = option(
        None,
        "a row per logged step (loss, lr, samples/s; with several processes each rank's data, compute and"
        " communication seconds and memory, and any straggler named) and per epoch (validation figures):"
        " FILE.csv or FILE.jsonl",
        metavar="FILE",
    )
    tensorboard: str | None = option(
        None, "TensorBoard event files in DIR, the same figures (needs `pip install tensorboard`)", metavar="DIR"
    )
    dashboard: str | None = option(
        None,
        "serve a page of every rank's step time, phases and memory, and any straggler named, while the"
        " run trains: on 127.0.0.1:PORT only, by the main rank (default 8050; 0: any free port); needs"
        " torchfleet[dashboard]",
        nargs="?",
        const="8050",
        metavar="PORT",
    )
    max_grad_norm: float | None = option(
        None, "clip gradients to this global norm (over every shard and stage)", metavar="NORM"
    )
    activation_checkpointing: bool = option(
        False, "recompute each block's activations in backward: less memory, more compute"
    )
    # --compile alone means "blocks"; Python callers may also pass True for it.
    compile: bool | str = option(
        False,
        "torch.compile each block (default) or the whole model",
        nargs="?",
        const="blocks",
        choices=("blocks", "model"),
    )
    progress: bool = option(True, "no progress bar")  # on by default, so its flag is --no-progress
    # Not flags of their own: strategies/options.py declares them, shared with bench, each passed only when given.
    strategy_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy != "auto" and registry.find(self.strategy) is None:
            raise choice_error("strategy", self.strategy, ("auto", *registry.names()))
        own = self.hf_model is not None or is_user_model(self.model)  # a language model of the user's
        if not own and self.model not in MODELS:
            raise choice_error("model", self.model, (*MODELS, "MODULE:FUNCTION"))
        if self.hf_model is not None:
            check_hf_model(self.hf_model)
        elif own:
            user_function(self.model)  # an import that fails is one sentence here, before any process starts
        if self.data is None:
            self.data = "text" if own or self.model in TOKEN_MODELS else "digits"
        if own and self.data not in TOKEN_DATASETS:
            raise UsageError(
                f"--data {self.data} holds images, and {'--hf-model' if self.hf_model else '--model ' + self.model}"
                f" is trained as a language model; use --data {TOKEN_DATASETS[0]} (its default) or leave --data out"
            )
        if self.data not in DATASETS:
            self._check_data_path(self.data)
        elif self.tokenizer is not None:
            raise UsageError(f"--tokenizer is for --data FILE.jsonl or .parquet documents, not --data {self.data}")
        elif self.model in TOKEN_MODELS and self.data not in TOKEN_DATASETS:
            raise UsageError(
                f"--model {self.model} reads token sequences but --data {self.data} holds images;"
                f" use --data {TOKEN_DATASETS[0]} (its default) or leave --data out"
            )
        if self.data in TOKEN_DATASETS and self.model not in TOKEN_MODELS and not own:
            raise UsageError(
                f"--data {self.data} holds token sequences for --model {' or '.join(TOKEN_MODELS)},"
                f" but --model {self.model} classifies images; use --data digits or synthetic"
            )
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
        if self.dashboard is not None:
            from torchfleet.view.server import dashboard_port  # the page's code only where it is asked for

            dashboard_port(self.dashboard)
        if not self.hang_timeout >= 0:
            raise UsageError(f"--hang-timeout {self.hang_timeout} must be 0 (off) or a positive number of seconds")
        if self.max_steps is not None:
            at_least("--max-steps", self.max_steps, 1)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise UsageError(f"--max-grad-norm {self.max_grad_norm} must be a positive number")
        if not self.lr > 0:
            raise UsageError(f"--lr {self.lr} must be a positive number")
        parse_signals(self.preempt_signals)  # an unknown name is refused here, before any process starts
        check_spec(self.preempt_notice)
        if self.resume not in (False, True, RESUME_AUTO):
            raise UsageError(
                f"--resume {self.resume!r} is not a choice; give --resume alone (continue from the"
                f" newest checkpoint) or --resume {RESUME_AUTO} (continue when there is one, else start"
                " from the beginning)"
            )
        if (self.resume or self.resume_fallback) and not self.checkpoint_dir:
            flag = "--resume" if self.resume else "--resume-fallback"
            raise UsageError(f"{flag} needs --checkpoint-dir to say where the checkpoints are")

    def _check_data_path(self, path: str) -> None:
        kind = path_kind(path)
        if self.model not in TOKEN_MODELS:
            raise UsageError(
                f"--data {path!r} holds {kind} for --model {' or '.join(TOKEN_MODELS)}, but --model {self.model}"
                " classifies images; use --data digits or synthetic"
            )
        if kind == DOCUMENTS and self.tokenizer is None:
            raise UsageError(
                f"--data {path!r} holds documents, which need --tokenizer DIR, a local tokenizer directory"
            )
        if kind == SHARDS and self.tokenizer is not None:
            raise UsageError(f"--data {path!r} holds token shards, already tokenized; leave --tokenizer out")

    @property
    def data_path(self) -> bool:
        """Whether --data is a path (the user's tokens), not a built-in data set."""
        return self.data not in DATASETS

    def check_outputs(self) -> None:
        """Refuse an output path that cannot be written, before any work is done."""
        if self.checkpoint_dir:
            check_writable_dir(self.checkpoint_dir, "--checkpoint-dir")
        if self.json_out:
            check_writable_file(self.json_out, "--json-out")
        if self.save_model:
            check_writable_file(self.save_model, "--save-model")
        if self.metrics_out:
            check_writable_file(self.metrics_out, "--metrics-out")
        if self.tensorboard:
            check_tensorboard()
            check_writable_dir(self.tensorboard, "--tensorboard")


def check_dashboard(port: str) -> None:
    """--dashboard's libraries are here and its port is free on 127.0.0.1: said before any process starts.
    (The main rank binds it again when it starts; a port taken in between is refused there, as here.)"""
    from torchfleet.view import check_installed
    from torchfleet.view.server import DashboardServer, dashboard_port

    check_installed("--dashboard")
    number = dashboard_port(port)
    if number:
        DashboardServer(number).close()
