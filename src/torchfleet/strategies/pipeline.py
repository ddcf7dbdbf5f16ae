"""pipeline, ddp+pipeline and fsdp+pipeline: each process holds one stage of the model.

Every preset of the parallel dimensions with ``pp > 1`` runs here
(strategies/dims.py): ``pipeline`` is one pipeline through every process,
``ddp+pipeline`` replicates it (DDP on each stage across replicas), and
``fsdp+pipeline`` shards each stage across its data-parallel group (FSDP2).
An ``nn.Sequential`` is cut into consecutive stages balanced by parameter
count; a model that declares a pipeline plan is cut by it (plan_cut.py), any
other model by tracing it (cutting.py). `torch.distributed.pipelining` runs each batch as `microbatches`
micro-batches under the GPipe or 1F1B schedule; the last stage computes the
loss. The stages of one pipeline read the same batch (the first stage uses
the inputs, the last the targets), so a pipeline counts as one data-parallel
rank.

Gradients across replicas or shards are synchronised by DDP or FSDP2 inside
torch's schedule, once per schedule step at the last micro-batch; with
`grad_accum` > 1 that is once per accumulation step (the sums are still the
batch's gradient: an average already equal on every rank averages to
itself).

Equivalence with `serial`: each micro-batch's mean loss is divided by
(microbatches x grad_accum) before backward (the schedule's own grad
scaling is off, since it would divide earlier accumulation steps again), so
the summed gradients are the gradient of the whole batch's mean loss.

Stages keep the model's own names ("3.weight", "model.layers.2..."), so the
full state dict gathered on rank 0 has the original keys in the original
order (stage_state.py), and a checkpoint (each stage writes its own layers
through DCP) loads into any other cut of the same model.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from torchfleet.errors import UsageError, choice_error
from torchfleet.strategies import cutting
from torchfleet.strategies.base import SetupArgs, batch_size, split_batch
from torchfleet.strategies.blocks import parameter_names
from torchfleet.strategies.cutting import tied_groups
from torchfleet.strategies.distributed import MeshStrategy
from torchfleet.strategies.fsdp import memory_per_rank, rebuild_optimizer
from torchfleet.strategies.knobs import checkpoint_activations, compile_model
from torchfleet.strategies.parallelize import parallelize, split_balanced
from torchfleet.strategies.plan_cut import cut_by_plan, declared_plan
from torchfleet.strategies.stage_state import ModelKeys, gather_stages, load_stage
from torchfleet.strategies.stages import (
    TimedStage,
    default_microbatches,
    has_pointwise_convs,
    rows,
    sequential_ties,
)
from torchfleet.strategies.transfer import recv_tensors, send_tensors

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
__all__ = ["SCHEDULES", "Pipeline", "split_balanced"]


class Pipeline(MeshStrategy):
    name = "pipeline"
    options = (*MeshStrategy.options, "microbatches", "schedule")
    schedules_steps = True
    sharded_checkpoint = True  # each stage saves its own layers through torch.distributed.checkpoint

    def __init__(self, runtime, microbatches: int | None = None, schedule: str = "1f1b", **options):
        if schedule not in SCHEDULES:
            raise choice_error("schedule", schedule, tuple(SCHEDULES))
        super().__init__(runtime, **options)
        self.pp, self.dp = self.dims.pp, self.dims.dp
        self.stage_index, self.dp_rank = self.coords["pp"], self.dims.dp_rank(self.rank)
        self._default_microbatches = microbatches is None  # chosen at the first step, to fit the batch
        self.microbatches = microbatches if microbatches is not None else 2 * self.pp
        if self.microbatches < 1:
            raise UsageError(f"--microbatches {self.microbatches} must be at least 1")
        if schedule == "1f1b" and self.microbatches < self.pp:
            raise UsageError(f"schedule 1f1b needs at least as many micro-batches as stages:"
                             f" --microbatches {self.microbatches} < {self.pp} stages; use gpipe or more micro-batches")
        self.schedule_name = schedule
        self._schedule = None
        self._busy_wall = [0.0, 0.0]  # stage busy seconds, schedule seconds (after the first step)
        self._pointwise_convs = False  # the model has 1x1 convolutions (set in wrap)
        self._steps = 0

    # -- wrapping ---------------------------------------------------------
    def cuts_by_tracing(self, model) -> bool:
        return not isinstance(model, nn.Sequential) or bool(self.split_points)

    def wrap(self, model, optimizer, args):
        device = self.runtime.device
        mesh = self.build_mesh()
        self.pp_group = mesh["pp"].get_group()
        old_names = parameter_names(model)
        # What save_model and checkpoints hold: the model's own keys, whatever a cut adds or drops.
        self.model_keys = ModelKeys(list(model.state_dict()), tied_groups(model))
        self._pointwise_convs = has_pointwise_convs(model)  # before the trace sizes the micro-batches
        self.cut = self._cut(model, args) if self.cuts_by_tracing(model) else None
        # The stage (sharded by FSDP2 in place with replicas or shards), and what runs it: the stage.
        self.model, runner, self.bounds = parallelize(
            model, dims=self.dims, mesh=mesh, device=device, precision=self.runtime.precision,
            stage=self.stage_index, cut_stage=self.cut.module if self.cut else None,
            fsdp_classes=self.fsdp_units)
        if self.cut is None:
            self.tied = sequential_ties(model, self.bounds)
        else:
            self.tied = list(zip(self.cut.tied, self.cut.holders, strict=True))
        self._tie_groups = self._tied_process_groups()
        # Only this stage's parameters, each group keeping its hyper-parameters.
        self.optimizer = rebuild_optimizer(optimizer, old_names, self.model)
        self.runtime.precision.sync_overflow(dist.group.WORLD)
        self._stage = TimedStage(runner, self.stage_index, self.pp, device, group=self.pp_group)
        self._driving = False  # True while train_step or predict runs the stage
        self.model.register_forward_pre_hook(self._refuse_direct_call)
        return self.model, self.optimizer

    def _refuse_direct_call(self, _module, _args):
        # A stage called by the user's own loop gets another stage's inputs (images
        # for a middle stage, targets as class indices...) and fails with an error
        # about those; say what is wrong instead.
        if not self._driving:
            raise UsageError(f"under {self.name} each process holds one stage of the model, and torch's"
                             " pipeline schedule runs it: call fleet.train_step(inputs, targets, loss_fn)"
                             " and fleet.predict(inputs) instead of the model")

    def _cut(self, model, setup: SetupArgs) -> cutting.Cut:
        """Cut a model that is not a Sequential: by its own pipeline plan, or by tracing one example micro-batch."""
        example, grad_accum = setup.example, setup.grad_accum
        if example is None:
            raise UsageError(
                f"{self.name} cuts a {type(model).__name__} into stages and needs one batch to trace it"
                " (or, with a pipeline plan, to size the stages):"
                " fleet.setup(model, optimizer, example_inputs=batch)")
        per_step = batch_size(example) // grad_accum
        if self._default_microbatches:
            self._fit_default_microbatches(per_step)
        if per_step % self.microbatches or per_step < self.microbatches:
            raise UsageError(f"each pipeline's batch of {per_step} does not split into {self.microbatches}"
                             f" micro-batches; use a batch size per replica that is a multiple of it")
        micro = split_batch(example, batch_size(example) // (per_step // self.microbatches))[0]
        args, kwargs = ((), dict(micro)) if isinstance(micro, dict) else ((micro,), {})
        model.to(self.runtime.device)  # the example is there already
        plan = declared_plan(model)
        if plan is not None:
            cut = cut_by_plan(model, plan, self.pp, self.stage_index, self.split_points, args, kwargs)
            self.notes.append(f"pipeline stages from {type(model).__name__}'s own pipeline plan"
                              f" ({', '.join(plan)}), cut at {', '.join(cut.starts)}")
        else:
            cut = cutting.trace(model, self.pp, self.stage_index, self.split_points, args, kwargs)
        checkpointing, compile_mode = setup.activation_checkpointing, setup.compile
        # A traced stage is one graph: checkpointed and compiled as a whole; a plan's keeps its blocks.
        how = "each pipeline stage as a whole (traced)" if plan is None else "each block of each pipeline stage"
        if checkpointing:
            checkpoint_activations(cut.module)
            self.notes.append(f"activation checkpointing: {how}")
        if compile_mode:
            compile_model(cut.module, "model" if plan is None else "blocks")
            self.notes.append(f"torch.compile: {how}")
        return cut

    def _tied_process_groups(self) -> list:
        """For each tied parameter: the group of this replica's stages that hold a copy of it.

        Every rank makes every group, in the same order (torch requires it).
        """
        place = {(self.dims.dp_rank(r), self.dims.coords(r)["pp"]): r for r in range(self.runtime.env.world_size)}
        mine = []
        for _, holders in self.tied:
            chosen = None
            for dp_rank in range(self.dp):
                group = dist.new_group([place[(dp_rank, stage)] for stage in holders])
                if dp_rank == self.dp_rank and self.stage_index in holders:
                    chosen = group
            mine.append(chosen)
        return mine

    def _sync_tied_gradients(self) -> None:
        """Sum a tied parameter's gradient over the stages holding copies: the one parameter's gradient."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for (names, _), group in zip(self.tied, self._tie_groups, strict=True):
            if group is None:
                continue
            param = next(params[n] for n in names if n in params)
            if not param.requires_grad:  # frozen (a fine-tuned model's tied embedding): nothing to sum
                continue
            if param.grad is None:  # this stage's copy took no part in the step: it adds nothing
                param.grad = torch.zeros_like(param)
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=group)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.pp - 1

    def _peer(self, stage: int) -> int:
        """Global rank of `stage` in this process's replica."""
        return dist.get_global_rank(self.pp_group, stage)

    # -- training ---------------------------------------------------------
    def _loss(self, output, target):
        if self.cut is not None:
            output = self.cut.unflatten(output)  # what the model returns in serial
        with self.runtime.precision.autocast():
            loss = self._loss_fn(output, target) / self._loss_divisor
        scaler = self.runtime.precision.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def _stage_inputs(self, batch) -> tuple[tuple, dict]:
        """What this stage takes from the model's inputs: the first stage all it reads, a later
        one the inputs it reads itself (a mask, nanoGPT's `targets`); the rest arrives from the
        stage before."""
        if self.cut is not None:
            return (), self.cut.stage_inputs(batch, self.is_first, self.is_last)
        if not self.is_first:
            return (), {}
        return ((), dict(batch)) if isinstance(batch, dict) else ((batch,), {})

    def _fit_default_microbatches(self, batch: int) -> None:
        fitted = default_microbatches(batch, self.pp, self.schedule_name == "1f1b", self._pointwise_convs
                                      and self.runtime.device.type == "cpu" and torch.get_num_threads() == 1)
        self.microbatches = fitted or self.microbatches

    def train_step(self, inputs, targets, loss_fn, grad_accum=1):
        size = batch_size(inputs)
        if self._schedule is None and self._default_microbatches and size % grad_accum == 0:
            self._fit_default_microbatches(size // grad_accum)
        per_run = grad_accum * self.microbatches
        if size % per_run:
            raise UsageError(
                f"each pipeline's batch of {size} does not split into {grad_accum} accumulation"
                f" steps x {self.microbatches} micro-batches; use a batch size per replica that is a"
                f" multiple of {per_run}")
        if self.cut is not None and size // per_run != self.cut.batch:
            raise UsageError(
                f"the pipeline's stages were traced for micro-batches of {self.cut.batch} samples and this"
                f" batch of {size} makes micro-batches of {size // per_run}; keep every batch the size of"
                " example_inputs (drop_last=True)")
        if self._schedule is None:
            self._schedule = SCHEDULES[self.schedule_name](
                self._stage, self.microbatches, loss_fn=self._loss, scale_grads=False)
        self._loss_fn, self._loss_divisor = loss_fn, per_run
        scaler = self.runtime.precision.scaler
        if scaler is not None and not self.is_last:
            # fp16: only the last stage scales a loss, but every stage's scaler
            # unscales its gradients; scaling a zero starts its scale (the same
            # on every stage, kept equal by the shared overflow verdict).
            scaler.scale(torch.zeros((), device=self.runtime.device))
        self.zero_grad()
        losses: list[torch.Tensor] = []  # one per micro-batch, as _loss returned them
        busy, tick = self._stage.busy, time.perf_counter()
        for x, y in zip(split_batch(inputs, grad_accum), targets.tensor_split(grad_accum), strict=True):
            args, kwargs = self._stage_inputs(x)
            run: list[torch.Tensor] = []  # the schedule clears the list it is given
            if self.is_last:
                # The losses are all train_step needs; merging the outputs would also fail on
                # a model that returns its own scalar loss (nanoGPT's (logits, loss)).
                kwargs.update(target=y, losses=run, return_outputs=False)
            self._driving = True
            try:
                self._schedule.step(*args, **kwargs)
            finally:
                self._driving = False
            losses += run
        self._stage._sync()
        if self._steps:  # the first step also infers shapes: leave it out of the bubble
            self._busy_wall[0] += self._stage.busy - busy
            self._busy_wall[1] += time.perf_counter() - tick
        self._steps += 1
        loss = torch.zeros((), device=self.runtime.device)
        if self.is_last:  # undo the scaling: the mean loss of the batch
            loss = torch.stack(losses).detach().float().sum() / (scaler.get_scale() if scaler else 1.0)
        self._sync_tied_gradients()
        self.apply_gradients()
        dist.broadcast(loss, src=self._peer(self.pp - 1), group=self.pp_group)  # every stage reports it
        return loss

    # -- inference: activations passed stage to stage -----------------------
    def clip_gradients(self):
        """Clip to the global norm of the whole model: every stage's and every shard's gradients.

        Each rank adds the squares of the gradient it holds; the sum over all
        ranks counts each replica once per replica (divided out) and a tied
        parameter once per stage holding it (only its first holder counts).
        """
        max_norm = self.runtime.max_grad_norm
        if max_norm is None:
            return None
        self.runtime.precision.unscale(self.optimizer)
        params = dict(self.model.named_parameters())
        skip = {id(params[n]) for (names, holders) in self.tied if holders[0] != self.stage_index
                for n in names if n in params}
        held = [(p, p.grad) for p in params.values() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for _, g in held]
        total = torch.zeros((), dtype=torch.float32, device=self.runtime.device)
        for (p, _), g in zip(held, local, strict=True):
            if id(p) not in skip:  # counted once, scaled on every stage below
                total += g.detach().float().pow(2).sum()
        dist.all_reduce(total)
        norm = (total / self.dims.dp_replicate).sqrt()
        # torch's clip_grad_norm_ formula, so a pipeline clips as serial does.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in local:
            g.mul_(coef.to(g.dtype))
        return norm

    @torch.no_grad()
    def predict(self, inputs):
        """The last stage returns the outputs; the other stages return None."""
        self._driving = True
        try:
            return self._predict(inputs)
        finally:
            self._driving = False

    def _predict(self, inputs):
        if self.cut is None:
            return self._predict_chunk(inputs)
        # Traced stages take micro-batches of the traced size only: pad the last chunk.
        size, step = batch_size(inputs), self.cut.batch
        outputs = []
        for start in range(0, size, step):
            chunk = rows(inputs, start, step)
            out = self._predict_chunk(chunk)
            if out is not None:
                outputs.append(out)
        if not self.is_last:
            return None
        merged = tuple(torch.cat(parts)[:size] for parts in zip(*outputs, strict=True))
        return self.cut.unflatten(merged)

    def _predict_chunk(self, inputs):
        device = self.runtime.device
        args, kwargs = self._stage_inputs(inputs)
        with self.runtime.precision.autocast():
            if not self.is_first:
                args = recv_tensors(self._peer(self.stage_index - 1), device)
            out = self.model(*args, **kwargs)
        if self.is_last:
            return (out,) if self.cut is not None and isinstance(out, torch.Tensor) else out
        send_tensors(out if isinstance(out, tuple) else (out,), self._peer(self.stage_index + 1), device)
        return None

    # -- the full model's state on rank 0 (weights export, fleet.save(sharded=False)) --
    def state_dicts(self):
        """Every stage's state gathered to rank 0 (replica 0's), keyed as in the whole model."""
        return gather_stages(self.model, self.optimizer, self.stage_index, self.dp_rank, self.model_keys)

    def is_model_key(self, key: str) -> bool:
        """Whether this stage's state-dict `key` is one of the model's own (a sharded checkpoint holds only those)."""
        return key in self.model_keys.names

    def load_state_dicts(self, model_state, optimizer_state):
        """Each rank takes its own stage's entries from the full state (and its shards of them)."""
        load_stage(self.model, self.optimizer, model_state, optimizer_state, self.model_keys)

    # -- reports ------------------------------------------------------------
    def memory_report(self):
        params = list(self.model.parameters())
        return memory_per_rank(params, [p.grad for p in params], self.optimizer)

    def pipeline_report(self) -> dict:
        """Measured idle fraction of each stage next to GPipe/1F1B's (p-1)/(m+p-1)."""
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.stage_index, *self._busy_wall))
        idle = []
        for stage in range(self.pp):
            busy = sum(b for s, b, _ in every if s == stage)
            wall = sum(w for s, _, w in every if s == stage)
            idle.append(round(1 - busy / wall, 3) if wall else float("nan"))
        p, m = self.pp, self.microbatches
        return {"schedule": self.schedule_name, "stages": p, "replicas": self.dp, "microbatches": m,
                "layers_per_stage": ([f"{a}-{b - 1}" for a, b in self.bounds] if self.bounds
                                     else [f"{name}.." for name in ("input", *self.cut.starts)] if self.cut
                                     else []),
                "bubble_formula": round((p - 1) / (m + p - 1), 3), "bubble_measured": idle}
