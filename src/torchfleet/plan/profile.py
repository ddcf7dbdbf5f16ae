"""A model's profile (Profile, StepFit): the figures every prediction starts from, and their serialisation.

plan/profiler.py measures them in this process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

OPTIMIZER_STATE = {"adamw": 8, "sgd": 4, "sgd-plain": 0}  # fp32 bytes per parameter: Adam's two moments; momentum


@dataclass
class StepFit:
    fixed_s: float
    per_sample_s: float

    def at(self, batch: float) -> float:
        return self.fixed_s + self.per_sample_s * batch


@dataclass
class Profile:
    model: str
    parameters: int
    block_parameters: int  # in the repeated blocks (what tp splits, what a pipeline spreads over stages)
    largest_unit: int  # parameters of the largest fsdp unit (a block, or the root's remainder)
    units: int
    boundary_bytes_per_sample: float  # one block's output
    tokens_per_sample: int | None
    flops_per_sample: float | None
    optimizer: str
    activation_per_sample: float  # bytes of the forward-and-backward peak per sample
    activation_fixed: float  # its batch-independent part (gradients alive at the peak, temporaries)
    optimizer_temporaries: float  # the optimizer step's peak above parameters, gradients and state
    time: dict[int, StepFit] = field(default_factory=dict)  # threads -> fit
    probe_batches: tuple[int, ...] = (1, 2)
    pointwise_convs: bool = False  # 1x1 convolutions: the pipelines keep bigger micro-batches on CPU
    tensors: int = 0  # parameter tensors: DDP's reducer pays a hook and a copy for each
    tp_linears: int = 0  # the Linears the model's tensor-parallel plan splits (tp pays its overhead per each)
    optimizer_s: dict[int, float] = field(default_factory=dict)  # threads -> the optimizer's step alone
    workload: str = ""  # workload_name(): what contention.py's figures are cached under
    memory_batches: tuple[int, ...] = ()  # the two batches the activation line goes through
    # Its experts (plan/experts.py), what expert parallelism splits and routes tokens to; 0 without any.
    experts: int = 0  # a layer's
    expert_layers: int = 0
    expert_parameters: int = 0
    routed_bytes_per_sample: float = 0.0  # one all-to-all's rows a sample, over every layer
    tp_whole_parameters: int = 0  # of block_parameters, those tp leaves whole on every rank (gpt-moe's experts)
    # The forward-and-backward peak above the state at the local batches the plan's ranks run, measured at each
    # (on fake tensors): what a rank that runs the whole model unsharded holds, without the line's extrapolation.
    peak_above_state: dict[int, float] = field(default_factory=dict)

    @property
    def tp_split_parameters(self) -> int:
        return self.block_parameters - self.tp_whole_parameters

    @property
    def param_bytes(self) -> int:
        return 4 * self.parameters

    def optimizer_bytes(self, parameters: float) -> float:
        return OPTIMIZER_STATE[self.optimizer] * parameters

    def optimizer_time(self, threads: int, otherwise: float) -> float:
        """Seconds of the optimizer's step at `threads` (the nearest measured below), `otherwise` if unmeasured."""
        known = [t for t in self.optimizer_s if t <= threads]
        return self.optimizer_s[max(known)] if known else otherwise

    def step_fit(self, threads: int) -> StepFit:
        known = max((t for t in self.time if t <= threads), default=min(self.time))
        return self.time[known]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["time"] = {str(t): asdict(f) for t, f in self.time.items()}
        out["peak_above_state"] = {str(b): v for b, v in self.peak_above_state.items()}
        return out
