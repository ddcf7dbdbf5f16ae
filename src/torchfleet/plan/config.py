"""What `torchfleet plan` plans, validated once: the model, the global batch, the target."""

from __future__ import annotations

from dataclasses import dataclass

from torchfleet.bench import user_model
from torchfleet.config import at_least
from torchfleet.errors import UsageError, choice_error
from torchfleet.plan.kernels import ATTENTION, COMPILE_COMPONENTS, DISPATCH
from torchfleet.plan.profile import OPTIMIZER_STATE
from torchfleet.strategies import registry
from torchfleet.train.models import GPT_PRESETS, MODELS


@dataclass
class PlanConfig:
    model: str = "cnn"
    gpt_preset: str = "tiny"
    image_size: int = 224
    batch: int | None = None  # global; None: bench's first default batch for the model
    optimizer: str = "adamw"
    precision: str = "fp32"
    strategies: tuple[str, ...] = ()  # empty: every one that can be planned for the target
    nproc: tuple[int, ...] = ()  # process counts; empty: 1, 2, 4 here, powers of two up to the devices there
    nodes: int | None = None  # a described cluster when any of nodes, gpus_per_node, cpus_per_node is given
    gpus_per_node: int | None = None
    cpus_per_node: int | None = None
    gpu: str | None = None
    tflops: float | None = None
    memory_gb: float | None = None
    mfu: float | None = None  # None: hardware.DEFAULT_MFU for the precision
    link_gbit: float | None = None  # between machines
    intra_gbit: float | None = None  # within a machine
    reprobe: bool = False
    json_out: str | None = None
    chart: str | None = None
    check: bool = False
    warmup: int = 2
    steps: int = 5
    cell_timeout_s: float = 300.0
    seed: int = 0
    schedule: str | None = None  # the pipelines' (strategies/pipeline/schedules.py); None: their default
    stages_per_process: int | None = None
    hf_config: str | None = None  # a library model planned at scale on fake tensors (plan/at_scale.py)
    seq_len: int | None = None  # None: library_model.default_seq of the model
    decoder_seq_len: int | None = None  # an encoder-decoder's; None: seq_len
    attention: str = "fused"  # --hf-config: how attention runs (plan/kernels.py's ATTENTION)
    local_batch: int = 2
    ac: str = "selective"
    tp: tuple[int, ...] = ()  # --hf-config's tensor-parallel degrees; empty: 1 and a node's GPUs where they divide
    pp: tuple[int, ...] = ()  # --hf-config's pipeline degrees; empty: none
    ep: tuple[int, ...] = ()  # --hf-config's expert-parallel degrees; empty: a node's worth for a model with experts
    # Not a flag: the config of a transformers model that --model's builder returned (built on the meta device),
    # planned at scale as --hf-config's are when a GPU cluster is described.
    library_fields: dict | None = None
    global_batch: int | None = None  # --hf-config's, the same on every row; None: local_batch a data-parallel GPU
    microbatches: int | None = None  # --hf-config's pipelines' a step; None: micro-batches of one sample
    # --hf-config: what torch.compile compiles (plan/kernels.py's COMPILE_COMPONENTS): its fused step priced
    # (plan/kernels.py) and held (plan/compiled.py); empty: eager
    compile: tuple[str, ...] = ()
    float8: bool = False  # --hf-config: price float8 linear layers (plan/kernels.py)
    # --hf-config: how fsdp+ep's rows travel (plan/experts_at_scale.py's DISPATCH): a row per chosen expert, or
    # DeepEP's one a token and rank
    ep_dispatch: str = "all-to-all"

    @property
    def described(self) -> bool:
        return any(v is not None for v in (self.nodes, self.gpus_per_node, self.cpus_per_node))

    def __post_init__(self) -> None:
        if self.hf_config is not None:
            self._check_at_scale()
        if user_model.is_user_model(self.model):
            # Built on the meta device (a bad one fails here, in one sentence): a 70 B model costs its modules only.
            from torchfleet.plan.library_model import checked, fields_of

            fields = fields_of(user_model.build_on_meta(self.model))
            if fields is not None and (self.gpus_per_node or self.gpu or self.tflops):
                self.library_fields = checked(fields, f"--model {self.model}'s config")
                self._check_at_scale()
        elif self.model not in MODELS:
            raise choice_error("model", self.model, (*MODELS, "MODULE:FUNCTION"))
        if self.global_batch is not None and self.hf_config is None and self.library_fields is None:
            raise UsageError(
                f"--global-batch {self.global_batch} is --hf-config's; a --model plan's global batch is --batch-size"
            )
        for part in self.compile:
            if part not in COMPILE_COMPONENTS:
                raise choice_error("--compile component", part, COMPILE_COMPONENTS)
        if (self.compile or self.float8) and self.hf_config is None and self.library_fields is None:
            flag = "--compile" if self.compile else "--float8"
            raise UsageError(f"{flag} prices a step traced at scale: give --hf-config with a GPU cluster")
        if self.ep_dispatch not in DISPATCH:
            raise choice_error("--ep-dispatch", self.ep_dispatch, DISPATCH)
        if self.ep_dispatch != DISPATCH[0] and self.hf_config is None and self.library_fields is None:
            raise UsageError(
                f"--ep-dispatch {self.ep_dispatch} prices fsdp+ep's rows at scale: give --hf-config with a GPU cluster"
            )
        if self.gpt_preset not in GPT_PRESETS:
            raise choice_error("gpt preset", self.gpt_preset, tuple(GPT_PRESETS))
        if self.optimizer not in OPTIMIZER_STATE:
            raise choice_error("optimizer", self.optimizer, tuple(OPTIMIZER_STATE))
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise choice_error("precision", self.precision, ("fp32", "bf16", "fp16"))
        for name in self.strategies:
            if registry.find(name) is None:
                raise choice_error("strategy", name, registry.names())
        at_least("--image-size", self.image_size, 1)
        if self.batch is not None:
            at_least("--batch-size", self.batch, 1)
        for n in self.nproc:
            at_least("--nproc", n, 1)
        if self.nodes is not None and self.nodes < 1:
            raise UsageError(f"--nodes {self.nodes} must be at least 1: a plan needs a machine to run on")
        if self.gpus_per_node is not None and self.cpus_per_node is not None:
            raise UsageError("give --gpus-per-node or --cpus-per-node, not both: a node's processes run on one kind")
        if self.check and self.described:
            raise UsageError(
                "--check runs bench here, so it checks plans for this machine only; leave out"
                " --nodes, --gpus-per-node and --cpus-per-node"
            )
        if self.schedule is not None or self.stages_per_process is not None:
            from torchfleet.strategies.pipeline.schedules import check_schedule

            check_schedule(self.schedule, 2, self.stages_per_process)  # a bad pair is one sentence, as in bench
        at_least("--steps", self.steps, 2)
        at_least("--warmup", self.warmup, 0)
        for flag, value in (
            ("--link", self.link_gbit),
            ("--intra-link", self.intra_gbit),
            ("--tflops", self.tflops),
            ("--memory-gb", self.memory_gb),
        ):
            if value is not None and not value > 0:
                raise UsageError(f"{flag} {value:g} must be above 0")

    def _check_at_scale(self) -> None:
        """--hf-config's flags (plan/at_scale.py): a model traced for a described GPU cluster, never run here."""
        from torchfleet.plan.trace import AC_MODES

        if self.cpus_per_node is not None or not (self.gpus_per_node or self.gpu or self.tflops):
            raise UsageError(
                "--hf-config plans a described GPU cluster: give --gpus-per-node with --gpu (or --tflops"
                " and --memory-gb), and --nodes for more than one machine"
            )
        if self.check:
            raise UsageError("--check runs the model here, which --hf-config's models are too big for; leave out one")
        if self.ac not in AC_MODES:
            raise UsageError(f"--ac {self.ac!r} is not a checkpointing mode; choose one of {', '.join(AC_MODES)}")
        if self.precision not in ("bf16", "fp32"):
            raise UsageError(
                f"--precision {self.precision} is not planned at scale; choose bf16 (bf16 compute, fp32"
                " master weights and reduction, as torchtitan trains) or fp32"
            )
        if self.seq_len is not None:
            at_least("--seq-len", self.seq_len, 1)
        if self.attention not in ATTENTION:
            raise choice_error("--attention", self.attention, ATTENTION)
        if self.decoder_seq_len is not None:
            at_least("--decoder-seq-len", self.decoder_seq_len, 1)
        at_least("--local-batch", self.local_batch, 1)
        if self.global_batch is not None:
            at_least("--global-batch", self.global_batch, 1)
        if self.microbatches is not None:
            at_least("--microbatches", self.microbatches, 1)
        for degree in self.pp:
            at_least("--pp", degree, 1)
        for degree in self.ep:
            at_least("--ep", degree, 1)
        for degree in self.tp:
            at_least("--tp", degree, 1)
            if self.gpus_per_node and degree > self.gpus_per_node:
                raise UsageError(
                    f"--tp {degree} is more than a node's {self.gpus_per_node} GPUs: tensor parallelism"
                    " gathers and scatters at every block, which plan keeps on one node's links"
                )
