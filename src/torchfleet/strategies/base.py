"""The one protocol every strategy follows, and the default training step.

A strategy wraps a model and optimizer for one way of running in parallel;
it never starts processes (the launcher does) and never loops over data (the
trainer does). Most strategies only override `wrap` and `no_sync`; those that
schedule their own forward and backward (pipelines) override `train_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

import torch
from torch import nn

from torchfleet.env import DistEnv
from torchfleet.errors import UsageError
from torchfleet.precision import Precision
from torchfleet.strategies.block_transforms import checkpoint_activations, compile_model
from torchfleet.strategies.blocks import adapter_skeleton
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategies.registry import name_of_class

# (what the model returns: a tensor, or a library model's output object; targets) -> loss
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
# A batch of inputs: one tensor (``model(x)``) or a dict of tensors (``model(**x)``,
# how Hugging Face models are called), each split along its first dimension.
Batch = torch.Tensor | Mapping[str, torch.Tensor]


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """`batch` cut into `parts` consecutive pieces along the first dimension."""
    if isinstance(batch, Mapping):
        pieces = {k: v.tensor_split(parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in pieces.items()} for i in range(parts)]
    return list(batch.tensor_split(parts))


def batch_size(batch: Batch) -> int:
    return len(next(iter(batch.values()))) if isinstance(batch, Mapping) else len(batch)


def span(names: list[str]) -> str:
    """The blocks a knob went to, for a note: one name, or the first and last of several."""
    return names[0] if len(names) == 1 else f"{len(names)} blocks, {names[0]}..{names[-1]}"


def forward(model: nn.Module, batch: Batch):
    """The model on one batch: keyword arguments for a dict, one argument otherwise."""
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


@dataclass(frozen=True)
class SetupArgs:
    """What `Fleet.setup` hands a strategy's `wrap` besides the model and optimizer."""

    example: Batch | None = None  # one batch as train_step will get it: a pipeline traces with it
    grad_accum: int = 1  # accumulation steps per batch: a pipeline's micro-batches are cut from each
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    compile: bool | str = False  # torch.compile each block (True, "blocks") or the whole model ("model")


class Replicas(Protocol):
    """Replica groups beside this one that share each step (per-step fault tolerance, replica_groups/per_step.py)."""

    def start_step(self) -> None: ...  # at zero_grad: the step's quorum is formed meanwhile
    def average(self, optimizer: torch.optim.Optimizer) -> None: ...  # the gradients, across the groups
    def commit(self) -> bool: ...  # whether this step may be applied (every group got through it)
    def stepped(self) -> None: ...  # after the optimizer step (diloco and localsgd meet every few steps)


@dataclass
class Runtime:
    """What a strategy may rely on: set up by Fleet before `wrap` is called."""

    env: DistEnv
    device: torch.device
    precision: Precision
    backend: str | None  # None when no process group was started
    max_grad_norm: float | None = None  # clip gradients to this global norm before each step
    replicas: Replicas | None = None  # other replica groups to average with each step (--fault-tolerance step)


class Strategy:
    # The preset's name: the first preset that runs the class (__init_subclass__), declared in the registry alone;
    # a MeshStrategy instance sets the one its degrees make (ddp+pipeline).
    name: str
    # True when the strategy needs one process per replica or stage and a
    # process group joining them; False for single-process strategies.
    distributed: ClassVar[bool] = False
    # The options this strategy takes: StrategyOptions' field names (its flags without "--").
    takes: ClassVar[tuple[str, ...]] = ()
    # True when the strategy runs on the CPU whatever GPUs the host has (hogwild).
    cpu_only: ClassVar[bool] = False
    # True when forward and backward run inside torch's pipeline schedule, so only
    # train_step can drive them (a hand-written loop cannot).
    schedules_steps: ClassVar[bool] = False
    # True when BatchNorm statistics are all-reduced across processes (MeshStrategy's option).
    sync_batchnorm: bool = False
    # A peft model's structure on the meta device, kept by setup for an adapters-only save; None without adapters.
    adapters: nn.Module | None = None
    # True when `wrap` takes a model on the meta device and leaves each process's share of it there, for Fleet to
    # give storage and values (weights/deferred.py); otherwise Fleet makes the whole model first.
    wraps_meta: ClassVar[bool] = False
    # Set by a mesh class's wrap: what each step's forward and backward run inside (`within_step`).
    step_contexts: tuple = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        declared = name_of_class(f"{cls.__module__}:{cls.__qualname__}")
        if declared is not None:  # else its own, or its base's (a class no preset runs)
            cls.name = declared

    def __init__(self, runtime: Runtime, options: StrategyOptions | None = None):
        """`options`: the run's strategy options in their typed groups, as settled (strategy_spec.py); each
        class reads the groups it takes, and an option given that it does not take is refused here."""
        unknown = sorted(set((options or StrategyOptions()).given()) - set(self.takes))
        if unknown:
            raise UsageError(
                f"option {unknown[0]!r} does not apply to strategy {self.name!r}"
                + (f"; it takes {', '.join(self.takes)}" if self.takes else "; it takes no options")
            )
        self.runtime = runtime
        self.notes: list[str] = []  # said once to the user by Fleet's owner (the trainer prints them)

    # Set by wrap, before anything reads them.
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def cuts_by_tracing(self, model: nn.Module) -> bool:
        """True when `wrap` cuts `model` into stages (and applies checkpointing and compile to its stage itself)."""
        return False

    # -- wrapping ---------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, args: SetupArgs):
        """`Fleet.setup`'s call: checkpointing and compile on the model's blocks, then `wrap`.

        Both change the blocks in place before any wrapper sees them (strategies/block_transforms.py);
        a strategy that cuts the model needs its plain forward first, and applies them
        to its stage after the cut.
        """
        self.adapters = adapter_skeleton(model)
        self._compile_loss = args.compile == "model"
        if not self.cuts_by_tracing(model):
            if args.activation_checkpointing:
                self.notes.append("activation checkpointing: " + span(checkpoint_activations(model)))
            if args.compile:
                self.notes.append("torch.compile: " + span(compile_model(model, args.compile)))
        return self.wrap(model, optimizer, args)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, args: SetupArgs):
        self.model = model.to(self.runtime.device)
        self.optimizer = optimizer
        return self.model, self.optimizer

    def unwrapped(self) -> nn.Module:
        """The user's module, without wrappers: what checkpoints hold."""
        return self.model

    def state_dicts(self) -> tuple[dict, dict]:
        """(model, optimizer) state for a checkpoint; sharding strategies gather or shard here."""
        return self.unwrapped().state_dict(), self.optimizer.state_dict()

    def load_state_dicts(self, model_state: dict, optimizer_state: dict) -> None:
        self.unwrapped().load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)

    def no_sync(self):
        """Skip gradient synchronisation (gradient accumulation's early micro-steps)."""
        return contextlib.nullcontext()

    # -- data -------------------------------------------------------------
    def data_coords(self) -> tuple[int, int]:
        """(rank, world size) among the processes that read different data."""
        return self.runtime.env.rank, self.runtime.env.world_size

    # -- training ---------------------------------------------------------
    def train_step(self, inputs: Batch, targets: torch.Tensor, loss_fn: LossFn, grad_accum: int = 1) -> torch.Tensor:
        """Forward, backward and optimizer step on this rank's share of one global batch.

        The share is split into `grad_accum` equal micro-batches; only the last
        one synchronises gradients, and each micro-loss is divided by
        `grad_accum`, so the update equals one pass over the whole share.
        Returns the mean loss of the share (detached).
        """
        precision = self.runtime.precision
        loss_fn = self.step_loss(loss_fn)
        self.zero_grad()
        if grad_accum == 1:
            # The common case, with nothing a hand-written loop would not do: no
            # split, no division by 1, no running total. Bit for bit the same
            # result as the general path below (x / 1 and 0 + x are exact).
            with self.within_step(inputs, targets):
                with precision.autocast():
                    loss = loss_fn(forward(self.model, inputs), targets)
                precision.backward(loss)
            self.before_step()
            self.apply_gradients()
            return loss.detach().float()
        total = torch.zeros((), device=self.runtime.device)
        pairs = list(zip(split_batch(inputs, grad_accum), targets.tensor_split(grad_accum), strict=True))
        for i, (x, y) in enumerate(pairs):
            sync = i == len(pairs) - 1
            with contextlib.nullcontext() if sync else self.no_sync(), self.within_step(x, y):
                with precision.autocast():
                    loss = loss_fn(forward(self.model, x), y)
                precision.backward(loss / grad_accum)
            total += loss.detach().float()
        self.before_step()
        self.apply_gradients()
        return total / grad_accum

    @contextlib.contextmanager
    def within_step(self, inputs: Batch, targets: torch.Tensor):
        """Around one forward and its backward: what a declared dimension's parallelism asked to enter (its
        `Dim.applies`, strategies/parallelize.py's `apply_declared`), in the mesh's order; nothing otherwise."""
        with contextlib.ExitStack() as stack:
            for context in self.step_contexts:
                stack.enter_context(context(inputs, targets))
            yield

    _compile_loss = False  # set by setup: with the whole model compiled, the loss is compiled too
    _compiled_loss: tuple[LossFn, LossFn] | None = None  # (the loss function given, its compiled form)

    def step_loss(self, loss_fn: LossFn) -> LossFn:
        """`loss_fn`, compiled where the whole model is (compile "model"). A language model's loss reads
        logits as large as the model's activations (gpt2 at 32 x 1,024 tokens: 3.3 GB in bf16); compiled,
        its softmax, log and gather are one pass over them instead of fp32 copies written and read back.
        The last function compiled is kept: a loop passing the same function pays the compilation once."""
        if not self._compile_loss:
            return loss_fn
        if self._compiled_loss is None or self._compiled_loss[0] is not loss_fn:
            self._compiled_loss = (loss_fn, torch.compile(loss_fn))
        return self._compiled_loss[1]

    def zero_grad(self) -> None:
        """The start of a step: gradients cleared, and the other replica groups' quorum asked for."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.runtime.replicas is not None:
            self.runtime.replicas.start_step()

    def apply_gradients(self) -> None:
        """The end of a step, after `before_step`: the gradients averaged with the other replica groups
        (if any), clipped, and stepped, unless the groups' commit says the step failed somewhere."""
        replicas = self.runtime.replicas
        if replicas is not None:
            replicas.average(self.optimizer)  # before clipping: the norm is the average's
        self.clip_gradients()
        if replicas is None:
            self.runtime.precision.step(self.optimizer)
        elif replicas.commit():
            self.runtime.precision.step(self.optimizer)
            replicas.stepped()

    def before_step(self) -> None:
        """Checks between backward and the optimizer step (ddp: every parameter got a gradient)."""

    def clip_gradients(self) -> torch.Tensor | None:
        """Scale the gradients down to `max_grad_norm` (their global norm); returns the norm before.

        Sharded gradients (FSDP2's DTensors) are clipped by torch's own
        clip_grad_norm_, whose norm covers every shard; pipelines override
        this to add up every stage's share.
        """
        max_norm = self.runtime.max_grad_norm
        if max_norm is None:
            return None
        self.runtime.precision.unscale(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    @torch.no_grad()
    def predict(self, inputs: Batch):
        with self.runtime.precision.autocast():
            return forward(self.model, inputs)

    def memory_report(self) -> dict | None:
        """Bytes held per rank, for strategies where that is the point (sharding)."""
        return None
