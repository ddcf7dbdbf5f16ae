"""The `Pipeline` strategy: it cuts the model (the package's docstring says how), wraps each stage,
and drives the stages through torch's schedule.

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

import torch
import torch.distributed as dist
from torch import nn

from torchfleet.errors import UsageError
from torchfleet.strategies.base import SetupArgs, batch_size, split_batch
from torchfleet.strategies.blocks import library_model, parameter_names
from torchfleet.strategies.distributed import MeshStrategy
from torchfleet.strategies.fsdp import memory_per_rank, rebuild_optimizer
from torchfleet.strategies.moe_balance import routes_to_the_loss
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategies.parallelize import parallelize
from torchfleet.strategies.pipeline import cutting, schedules
from torchfleet.strategies.pipeline.cutting import tied_groups
from torchfleet.strategies.pipeline.example_cut import cut_on_example
from torchfleet.strategies.pipeline.gradients import clip_to_global_norm, sync_tied_gradients, tied_process_groups
from torchfleet.strategies.pipeline.local_stages import (
    LocalStages,
    model_copy,
    run_stages,
    sequential_stages,
    share_tensors,
)
from torchfleet.strategies.pipeline.report import layers_per_stage, pipeline_report
from torchfleet.strategies.pipeline.stage_state import ModelKeys, gather_stages, load_stage
from torchfleet.strategies.pipeline.stages import (
    TAGGED_BACKENDS,
    TimedStage,
    default_microbatches,
    has_pointwise_convs,
    predict_in_chunks,
    receive_loss,
    send_loss,
    sequential_ties,
)
from torchfleet.strategies.pipeline.static_shapes import stage_shapes, static_stages

__all__ = ["Pipeline"]


class Pipeline(MeshStrategy):
    takes = (*MeshStrategy.takes, "microbatches", "schedule", "stages_per_process")
    schedules_steps = True
    sharded_checkpoint = True  # each stage saves its own layers through torch.distributed.checkpoint
    wraps_meta = True  # a Sequential's children and a plan's blocks are cut on meta tensors alike (not a trace)

    def __init__(self, runtime, options: StrategyOptions | None = None, dims=None):
        options = options or StrategyOptions()
        microbatches, schedule = options.pipeline.microbatches, options.pipeline.schedule
        stages_per_process = options.pipeline.stages_per_process
        if microbatches is not None and microbatches < 1:
            raise UsageError(f"--microbatches {microbatches} must be at least 1")
        # Before the degrees are known (a bad name is refused alike on any pp).
        schedules.check_schedule(schedule, 2, stages_per_process)
        super().__init__(runtime, options, dims)
        self.pp, self.dp = self.dims.pp, self.dims.dp
        self.pp_rank, self.dp_rank = self.coords["pp"], self.dims.dp_rank(self.rank)
        self._default_microbatches = microbatches is None  # chosen at the first step, to fit the batch
        self.microbatches = microbatches if microbatches is not None else 2 * self.pp
        name, self.per_process = schedules.check_schedule(schedule, self.pp, stages_per_process, microbatches)
        self.schedule_name, self.stages = name, self.pp * self.per_process  # stages of the whole model
        self.stage_rank = schedules.stage_ranks(name, self.pp, self.per_process)  # each stage's pipeline rank
        self.stage_indices = schedules.local_stages(name, self.pp, self.per_process, self.pp_rank)
        self._schedule = None
        self._busy_wall = [0.0, 0.0]  # stage busy seconds, schedule seconds (after the first step)
        self._pointwise_convs = False  # the model has 1x1 convolutions (set in wrap)
        self._steps = 0

    # -- wrapping ---------------------------------------------------------
    def cuts_by_tracing(self, model) -> bool:
        return not isinstance(model, nn.Sequential) or bool(self.split_points)

    def wrap(self, model, optimizer, args):
        if routes_to_the_loss(model):  # before any collective: every rank refuses alike
            raise UsageError(
                f"{self.name} cannot train {type(library_model(model)).__name__} with output_router_logits=True,"
                " because the router logits of earlier stages never reach the last stage's loss; set"
                " output_router_logits=False in the model's config (its load-balancing loss is then left out)"
            )
        device = self.runtime.device
        mesh = self.build_mesh()
        self.pp_group = mesh["pp"].get_group()
        old_names = parameter_names(model)
        # A fake group (plan's traces) cannot send the stages their shapes: a copy of the whole model gives them
        # at the first step (static_shapes.py).
        self._shapes_from = model_copy(model) if dist.get_backend(self.pp_group) == "fake" else None
        # What save_model and checkpoints hold: the model's own keys, whatever a cut adds or drops.
        self.model_keys = ModelKeys(list(model.state_dict()), tied_groups(model))
        self._pointwise_convs = has_pointwise_convs(model)  # before the trace sizes the micro-batches
        self.cuts = self._cut(model, args) if self.cuts_by_tracing(model) else []
        self.cut = self.cuts[0] if self.cuts else None  # what every local stage's cut shares (the output...)
        if self.cut is not None:
            modules, self.bounds = [c.module for c in self.cuts], None
            self.tied = list(zip(self.cut.tied, self.cut.holders, strict=True))
        else:
            assert isinstance(model, nn.Sequential)  # cuts_by_tracing takes every other model
            modules, self.bounds = sequential_stages(model, self.stages, self.stage_indices)
            self.tied = sequential_ties(model, self.bounds)
        share_tensors(modules, [names for names, _ in self.tied], self.model_keys.names)
        # Each stage (sharded by FSDP2 in place with replicas or shards), and what runs it.
        parts = [
            parallelize(
                module,
                dims=self.dims,
                mesh=mesh,
                device=device,
                precision=self.runtime.precision,
                cut_stage=module,
                fsdp_classes=self.fsdp_units,
            )
            for module in modules
        ]
        self.stage_modules = [part.module for part in parts]
        self.model = parts[0].module if len(parts) == 1 else LocalStages(self.stage_modules, self.model_keys.names)
        self._tie_groups = tied_process_groups(self.tied, self.dims, self.stage_rank, self.rank)
        # Only this process's parameters, each group keeping its hyper-parameters.
        self.optimizer = rebuild_optimizer(optimizer, old_names, self.model)
        self.runtime.precision.sync_overflow(dist.group.WORLD)
        self._stages = [
            TimedStage(part.runner, index, self.stages, device, group=self.pp_group)
            for part, index in zip(parts, self.stage_indices, strict=True)
        ]
        self._driving = False  # True while train_step or predict runs the stages
        for module in {id(m): m for m in (self.model, *self.stage_modules)}.values():
            module.register_forward_pre_hook(self._refuse_direct_call)
        if self.cut is not None:
            for cut, module in zip(self.cuts, self.stage_modules, strict=True):
                module.register_forward_pre_hook(self._inputs_hook(cut, module), with_kwargs=True)
        return self.model, self.optimizer

    def _inputs_hook(self, cut: cutting.Cut, module: nn.Module):
        """Give a cut stage what it reads of the model's inputs: the schedule hands every stage of a
        process the same keyword arguments (the model's inputs by name), and each takes its own."""
        index = self.stage_indices[self.stage_modules.index(module)]
        first, last = index == 0, index == self.stages - 1

        def take(_module, args, kwargs):
            return args, cut.stage_inputs(kwargs, first, last)

        return take

    def _refuse_direct_call(self, _module, _args):
        # A stage called by the user's own loop gets another stage's inputs (images
        # for a middle stage, targets as class indices...) and fails with an error
        # about those; say what is wrong instead.
        if not self._driving:
            raise UsageError(
                f"under {self.name} each process holds one stage of the model, and torch's"
                " pipeline schedule runs it: call fleet.train_step(inputs, targets, loss_fn)"
                " and fleet.predict(inputs) instead of the model"
            )

    def _cut(self, model, setup: SetupArgs) -> list[cutting.Cut]:
        """This process's stages of a model that is not a Sequential: by its own pipeline plan, or by tracing
        one example micro-batch (example_cut.py)."""
        if setup.example is None:
            raise UsageError(
                f"{self.name} cuts a {type(model).__name__} into stages and needs one batch to trace it"
                " (or, with a pipeline plan, to size the stages):"
                " fleet.setup(model, optimizer, example_inputs=batch)"
            )
        if self._default_microbatches:
            self._fit_default_microbatches(batch_size(setup.example) // setup.grad_accum)
        cuts, notes = cut_on_example(
            model, setup, self.microbatches, self.stages, self.stage_indices, self.split_points, self.runtime.device
        )
        self.notes += notes
        return cuts

    @property
    def is_first(self) -> bool:
        return self.stage_indices[0] == 0

    @property
    def is_last(self) -> bool:
        return self.stage_indices[-1] == self.stages - 1

    def _peer(self, stage: int) -> int:
        """Global rank of the process holding `stage` in this process's replica."""
        return dist.get_global_rank(self.pp_group, self.stage_rank[stage])

    # -- training ---------------------------------------------------------
    def _loss(self, output, target):
        if self.cut is not None:
            output = self.cut.unflatten(output)  # what the model returns in serial
        with self.runtime.precision.autocast():
            loss = self._loss_fn(output, target) / self._loss_divisor
        scaler = self.runtime.precision.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def _stage_inputs(self, batch) -> tuple[tuple, dict]:
        """What this process's stages take from the model's inputs: a cut stage takes its own of the
        inputs, passed by name (see _inputs_hook); a Sequential's first stage all of them; the rest
        arrives from the stage before."""
        if self.cut is not None:
            return (), dict(batch) if isinstance(batch, dict) else {self.cut.input_names[0]: batch}
        if not self.is_first:
            return (), {}
        return ((), dict(batch)) if isinstance(batch, dict) else ((batch,), {})

    def _fit_default_microbatches(self, batch: int) -> None:
        takes = lambda m: schedules.microbatch_problem(self.schedule_name, self.pp, m) is None  # noqa: E731
        fitted = default_microbatches(
            batch,
            self.pp,
            takes,
            self._pointwise_convs and self.runtime.device.type == "cpu" and torch.get_num_threads() == 1,
        )
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
                f" multiple of {per_run}"
            )
        if self.cut is not None and size // per_run != self.cut.batch:
            raise UsageError(
                f"the pipeline's stages were traced for micro-batches of {self.cut.batch} samples and this"
                f" batch of {size} makes micro-batches of {size // per_run}; keep every batch the size of"
                " example_inputs (drop_last=True)"
            )
        if self._schedule is None:
            problem = schedules.microbatch_problem(self.schedule_name, self.pp, self.microbatches)
            if problem:
                raise UsageError(problem)
            if self._shapes_from is not None:
                micro = split_batch(split_batch(inputs, grad_accum)[0], self.microbatches)[0]
                autocast = self.runtime.precision.autocast
                shapes = stage_shapes(self._shapes_from, micro, self.stages, self.split_points, autocast)
                self._stages, self._shapes_from = static_stages(self._stages, shapes), None
            self._schedule = schedules.build_schedule(self.schedule_name, self._stages, self.microbatches, self._loss)
            if self.per_process > 1:
                # Before 2.14 the multi-stage schedules open their links in one batch of sends and receives
                # to the same peers, which Gloo's not yet connected pairs failed ("Pair is not connected"
                # on 2.11); one collective over the pipeline connects its neighbours first.
                dist.all_reduce(torch.zeros(1, device=self.runtime.device), group=self.pp_group)
        self._loss_fn, self._loss_divisor = loss_fn, per_run
        scaler = self.runtime.precision.scaler
        if scaler is not None and not self.is_last:
            # fp16: only the last stage scales a loss, but every stage's scaler
            # unscales its gradients; scaling a zero starts its scale (the same
            # on every stage, kept equal by the shared overflow verdict).
            scaler.scale(torch.zeros((), device=self.runtime.device))
        self.zero_grad()
        # Every stage returns the loss, sent from the last stage (stages.py: receive_loss says when).
        loss, src = torch.zeros((), device=self.runtime.device), self._peer(self.stages - 1)
        early = not self.is_last and dist.get_backend(self.pp_group) in TAGGED_BACKENDS
        handing = receive_loss(loss, src, self.pp_group) if early else []
        losses: list[torch.Tensor] = []  # one per micro-batch, as _loss returned them
        busy, tick = self._busy(), time.perf_counter()
        for x, y in zip(split_batch(inputs, grad_accum), targets.tensor_split(grad_accum), strict=True):
            args, kwargs = self._stage_inputs(x)
            run: list[torch.Tensor] = []  # the schedule clears the list it is given
            if self.is_last:  # the losses are all train_step needs; merging the outputs would also
                # fail on a model that returns its own scalar loss (nanoGPT's (logits, loss)).
                kwargs.update(target=y, losses=run, return_outputs=False)
            self._driving = True
            try:
                self._schedule.step(*args, **kwargs)
            finally:
                self._driving = False
            losses += run
        self._stages[0]._sync()
        if self._steps:  # the first step also infers shapes: leave it out of the bubble
            self._busy_wall[0] += self._busy() - busy
            self._busy_wall[1] += time.perf_counter() - tick
        self._steps += 1
        if self.is_last:  # undo the scaling: the mean loss of the batch
            loss = torch.stack(losses).detach().float().sum() / (scaler.get_scale() if scaler else 1.0)
            handing = send_loss(loss, self.pp_group)
        elif not early:
            handing = receive_loss(loss, src, self.pp_group)
        sync_tied_gradients(self.model, self.tied, self._tie_groups)
        self.apply_gradients()
        for work in handing:
            work.wait()
        return loss

    def _busy(self) -> float:
        return sum(stage.busy for stage in self._stages)

    def clip_gradients(self):
        """Clip to the global norm of the whole model: every stage's and every shard's gradients (gradients.py)."""
        max_norm = self.runtime.max_grad_norm
        if max_norm is None:
            return None
        self.runtime.precision.unscale(self.optimizer)
        return clip_to_global_norm(
            self.model, self.tied, self.stage_rank, self.pp_rank, self.dims.dp_replicate, max_norm, self.runtime.device
        )

    # -- inference: activations passed stage to stage -----------------------
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
        merged = predict_in_chunks(inputs, self.cut.batch, self.cut.returns_scalar, self._predict_chunk, self.is_last)
        return None if merged is None else self.cut.unflatten(merged)

    def _predict_chunk(self, inputs):
        args, kwargs = self._stage_inputs(inputs)
        with self.runtime.precision.autocast():
            out = run_stages(
                list(zip(self.stage_indices, self.stage_modules, strict=True)),
                self.stages,
                args,
                kwargs,
                self._peer,
                self.runtime.device,
            )
        if self.is_last:
            return (out,) if self.cut is not None and isinstance(out, torch.Tensor) else out
        return None

    # -- the full model's state on rank 0 (weights export, fleet.save(sharded=False)) --
    def state_dicts(self):
        """Every stage's state gathered to rank 0 (replica 0's), keyed as in the whole model."""
        return gather_stages(self.model, self.optimizer, self.pp_rank, self.dp_rank, self.model_keys)

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
        """Measured idle fraction of each pipeline process (its stages together) next to the schedule's
        formula (schedules.bubble_formula: (p-1)/(m+p-1) for GPipe and 1F1B)."""
        return pipeline_report(
            self.schedule_name,
            self.pp,
            self.per_process,
            self.dp,
            self.microbatches,
            layers_per_stage(self.bounds, self.cut),
            self.pp_rank,
            self._busy_wall,
        )
