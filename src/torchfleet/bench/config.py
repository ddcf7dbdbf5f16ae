"""What `torchfleet bench` measures, validated once (config.py's rules)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchfleet.bench import user_model
from torchfleet.config import at_least
from torchfleet.errors import UsageError, choice_error
from torchfleet.precision import PRECISIONS
from torchfleet.strategies import registry
from torchfleet.strategies.block_transforms import COMPILE_MODES
from torchfleet.strategies.pipeline.schedules import schedule_variant
from torchfleet.train.config import OPTIMIZERS
from torchfleet.train.models import GPT_PRESETS, MODELS

# A round of sub-millisecond steps needs hundreds of them before its median stops moving with the timer's and
# the scheduler's jitter, while a few steps of a second each already agree: so rounds are sized by their time,
# not by a count of steps (docs/benchmarks; measure_cell.round_steps).
ROUND_TIME_S = 0.3
MAX_ROUND_STEPS = 2000  # a round of microsecond steps would otherwise take longer to time than to step


@dataclass
class BenchConfig:
    """What `torchfleet bench` measures. Empty tuples mean "choose for this machine"
    (bench.plan does, from doctor's availability and the hardware)."""

    model: str = "cnn"
    gpt_preset: str | None = None  # --model gpt's size; None: gpt2 with GPUs, tiny without (cells.resolve)
    image_size: int = 224  # --model resnet18/resnet50: mock images are 3 x image_size x image_size
    strategies: tuple[str, ...] = ()
    nproc: tuple[int, ...] = ()  # process counts for multi-process strategies
    batch_sizes: tuple[int, ...] = ()  # global
    precisions: tuple[str, ...] = ()
    warmup: int = 5
    steps: int = 30  # the fewest timed steps a round runs
    round_time_s: float = ROUND_TIME_S  # a round times as many steps as take this at their median (0: `steps`)
    rounds: int = 3  # each cell runs once per round, the rounds interleaved (bench/rounds.py)
    threads: int | None = None  # intra-op threads per process; None: usable cores / processes
    out: str = "runs/bench"
    seed: int = 0
    strategy_options: dict = field(default_factory=dict)
    cell_timeout_s: float = 1800.0  # a cell still running then is killed and reported
    compile: str | None = None  # torch.compile each block ("blocks") or the whole model ("model") in every cell
    optimizer: str = "sgd"  # sgd (momentum 0.9) or adamw (fused on a GPU): what every cell steps with
    channels_last: bool | None = None  # NHWC convolutions; None: Fleet's default (bf16 and fp16 on a GPU)

    def __post_init__(self) -> None:
        if user_model.is_user_model(self.model):
            user_model.build(self.model)  # imports and builds it once here: a bad one fails before any cell
        elif self.model not in MODELS:
            raise choice_error("model", self.model, (*MODELS, "MODULE:FUNCTION"))
        if self.gpt_preset is not None and self.gpt_preset not in GPT_PRESETS:
            raise choice_error("gpt preset", self.gpt_preset, tuple(GPT_PRESETS))
        at_least("--image-size", self.image_size, 1)
        for name in self.strategies:
            if registry.find(name) is None:
                base, _, schedule = name.partition("/")
                # A schedule's variant is of the plain pipeline: the preset of the pp dimension alone.
                if base != registry.name_of_degrees([registry.PP]) or not schedule:
                    raise choice_error("strategy", name, (*registry.names(), "pipeline/SCHEDULE"))
                schedule_variant(name)  # refuses a schedule that is unknown or cannot run here
        for name in self.precisions:
            if name not in PRECISIONS:
                raise choice_error("precision", name, PRECISIONS)
        for n in self.nproc:
            at_least("--nproc", n, 1)
        for b in self.batch_sizes:
            at_least("--batch-sizes", b, 1)
        at_least("--warmup", self.warmup, 0)
        at_least("--steps", self.steps, 2)  # a spread needs two steps
        at_least("--rounds", self.rounds, 1)
        if not 0 <= self.round_time_s < math.inf:  # NaN fails this too
            raise UsageError(f"--round-time {self.round_time_s:g} must be a number of seconds, 0 or more")
        if self.threads is not None:
            at_least("--threads", self.threads, 1)
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise choice_error("compile mode", self.compile, COMPILE_MODES)
        if self.optimizer not in OPTIMIZERS:
            raise choice_error("optimizer", self.optimizer, OPTIMIZERS)
        if not self.cell_timeout_s > 0:
            raise UsageError(f"cell timeout {self.cell_timeout_s} must be a positive number of seconds")
