"""pipeline, ddp+pipeline and fsdp+pipeline: each process holds one stage of the model.

Every preset of the parallel dimensions with ``pp > 1`` runs here
(strategies/dims.py): ``pipeline`` is one pipeline through every process,
``ddp+pipeline`` replicates it (DDP on each stage across replicas), and
``fsdp+pipeline`` shards each stage across its data-parallel group (FSDP2).
An ``nn.Sequential`` is cut into consecutive stages balanced by parameter
count, and `torch.distributed.pipelining` runs each batch as `microbatches`
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

Stages keep the Sequential's child names ("3.weight"), so the full state
dict gathered on rank 0 has the original keys in the original order, and a
checkpoint (each stage writes its own layers through DCP) loads into any
other cut of the same model.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, distribute_tensor

from torchfleet.errors import UsageError, choice_error
from torchfleet.strategies.distributed import MeshStrategy
from torchfleet.strategies.fsdp import memory_per_rank, rebuild_optimizer
from torchfleet.strategies.parallelize import parallelize, split_balanced

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
__all__ = ["SCHEDULES", "Pipeline", "split_balanced"]


class _Stage(PipelineStage):
    """A PipelineStage that times its compute.

    The schedules wait for received activations before calling these two
    methods and send asynchronously after, so the time inside them is the
    stage's busy time; the rest of a schedule step is idle (the bubble).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = 0.0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # device time, not launch time

    def forward_one_chunk(self, *args, **kwargs):
        self._sync()
        tick = time.perf_counter()
        out = super().forward_one_chunk(*args, **kwargs)
        self._sync()
        self.busy += time.perf_counter() - tick
        return out

    def backward_one_chunk(self, *args, **kwargs):
        self._sync()
        tick = time.perf_counter()
        out = super().backward_one_chunk(*args, **kwargs)
        self._sync()
        self.busy += time.perf_counter() - tick
        return out


class Pipeline(MeshStrategy):
    name = "pipeline"
    options = (*MeshStrategy.options, "microbatches", "schedule")
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
        self._steps = 0

    # -- wrapping ---------------------------------------------------------
    def wrap(self, model, optimizer):
        device = self.runtime.device
        mesh = self.build_mesh()
        self.pp_group = mesh["pp"].get_group()
        old_names = {id(p): n for n, p in model.named_parameters()}
        # The stage (sharded by FSDP2 in place with replicas or shards), and what runs it: the stage.
        self.model, runner, self.bounds = parallelize(model, self.dims, mesh, device, self.runtime.precision,
                                                      stage=self.stage_index)
        # Only this stage's parameters, each group keeping its hyper-parameters.
        self.optimizer = rebuild_optimizer(optimizer, old_names, self.model)
        self.runtime.precision.sync_overflow(dist.group.WORLD)
        self._stage = _Stage(runner, self.stage_index, self.pp, device, group=self.pp_group)
        return self.model, self.optimizer

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
        with self.runtime.precision.autocast():
            loss = self._loss_fn(output, target) / self._loss_divisor
        scaler = self.runtime.precision.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def _fit_default_microbatches(self, batch: int) -> None:
        """Without --microbatches: the most micro-batches, from 2 x stages down, that divide the batch."""
        lowest = self.pp if self.schedule_name == "1f1b" else 1
        fits = [m for m in range(2 * self.pp, lowest - 1, -1) if batch % m == 0]
        if fits:
            self.microbatches = fits[0]

    def train_step(self, inputs, targets, loss_fn, grad_accum=1):
        if self._schedule is None and self._default_microbatches and len(inputs) % grad_accum == 0:
            self._fit_default_microbatches(len(inputs) // grad_accum)
        per_run = grad_accum * self.microbatches
        if len(inputs) % per_run:
            raise UsageError(
                f"each pipeline's batch of {len(inputs)} does not split into {grad_accum} accumulation"
                f" steps x {self.microbatches} micro-batches; use a batch size per replica that is a"
                f" multiple of {per_run}")
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
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []  # one per micro-batch, as _loss returned them
        busy, tick = self._stage.busy, time.perf_counter()
        for x, y in zip(inputs.tensor_split(grad_accum), targets.tensor_split(grad_accum), strict=True):
            args = (x,) if self.is_first else ()
            run: list[torch.Tensor] = []  # the schedule clears the list it is given
            self._schedule.step(*args, **({"target": y, "losses": run} if self.is_last else {}))
            losses += run
        self._stage._sync()
        if self._steps:  # the first step also infers shapes: leave it out of the bubble
            self._busy_wall[0] += self._stage.busy - busy
            self._busy_wall[1] += time.perf_counter() - tick
        self._steps += 1
        loss = torch.zeros((), device=self.runtime.device)
        if self.is_last:  # undo the scaling: the mean loss of the batch
            loss = torch.stack(losses).detach().float().sum() / (scaler.get_scale() if scaler else 1.0)
        self.runtime.precision.step(self.optimizer)
        dist.broadcast(loss, src=self._peer(self.pp - 1), group=self.pp_group)  # every stage reports it
        return loss

    # -- inference: activations passed stage to stage -----------------------
    _DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        header = torch.zeros(8, dtype=torch.int64, device=tensor.device)
        header[0], header[1] = tensor.dim(), self._DTYPES.index(tensor.dtype)
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header, dst)
        dist.send(tensor.contiguous(), dst)

    def _recv(self, src: int) -> torch.Tensor:
        device = self.runtime.device
        header = torch.zeros(8, dtype=torch.int64, device=device)
        dist.recv(header, src)
        ndim, dtype = int(header[0]), self._DTYPES[int(header[1])]
        tensor = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
        dist.recv(tensor, src)
        return tensor

    @torch.no_grad()
    def predict(self, inputs):
        """The last stage returns the outputs; the other stages return None."""
        x = inputs if self.is_first else self._recv(self._peer(self.stage_index - 1))
        with self.runtime.precision.autocast():
            out = self.model(x)
        if self.is_last:
            return out
        self._send(out, self._peer(self.stage_index + 1))
        return None

    # -- the full model's state on rank 0 (weights export, fleet.save(sharded=False)) --
    def _named_optimizer_state(self) -> dict:
        """This stage's optimizer state keyed by parameter name, not position."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        sd = self.optimizer.state_dict()
        return {"state": {order[i]: s for i, s in sd["state"].items()},
                "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]}

    def state_dicts(self):
        """Every stage's state gathered to rank 0 (replica 0's), keyed as in the whole model."""
        # A sharded stage's tensors are gathered whole first, by every rank of its shard group.
        mine = _to_cpu(_full((self.stage_index, self.dp_rank, self.model.state_dict(),
                              self._named_optimizer_state())))
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        if every is None:
            return {}, {}
        stages = sorted((s for s in every if s[1] == 0), key=lambda s: s[0])
        model_state, state, groups = {}, {}, []
        for _, _, stage_model, stage_optim in stages:
            model_state.update(stage_model)
            state.update(stage_optim["state"])
            for i, g in enumerate(stage_optim["param_groups"]):
                if i == len(groups):
                    groups.append({**g, "params": []})
                groups[i]["params"] += g["params"]
        return model_state, {"state": state, "param_groups": groups}

    def load_state_dicts(self, model_state, optimizer_state):
        """Each rank takes its own stage's entries from the full state (and its shards of them)."""
        current = self.model.state_dict()
        self.model.load_state_dict({k: _like(model_state[k], v) for k, v in current.items()})
        names = {id(p): n for n, p in self.model.named_parameters()}
        params = dict(self.model.named_parameters())
        saved = {n: g for g in optimizer_state["param_groups"] for n in g["params"]}
        order, groups = [], []
        for g in self.optimizer.param_groups:
            group_names = [names[id(p)] for p in g["params"]]
            source = saved[group_names[0]] if group_names else g
            groups.append({**{k: v for k, v in source.items() if k != "params"},
                           "params": list(range(len(order), len(order) + len(group_names)))})
            order += group_names
        state = {i: {k: _like(v, params[n]) for k, v in optimizer_state["state"][n].items()}
                 for i, n in enumerate(order) if n in optimizer_state["state"]}
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    # -- reports ------------------------------------------------------------
    def memory_report(self):
        params = list(self.model.parameters())
        return memory_per_rank(params, [p.grad for p in params], self.optimizer)

    def pipeline_report(self) -> dict:
        """Measured idle fraction of each stage next to GPipe/1F1B's (p-1)/(m+p-1)."""
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.stage_index, *self._busy_wall))
        idle = []
        for stage in range(self.pp):
            busy = sum(b for s, b, _ in every if s == stage)
            wall = sum(w for s, _, w in every if s == stage)
            idle.append(round(1 - busy / wall, 3) if wall else float("nan"))
        p, m = self.pp, self.microbatches
        return {"schedule": self.schedule_name, "stages": p, "replicas": self.dp, "microbatches": m,
                "layers_per_stage": [f"{a}-{b - 1}" for a, b in self.bounds],
                "bubble_formula": round((p - 1) / (m + p - 1), 3), "bubble_measured": idle}


def _map_tensors(tree, fn):
    """`tree` (dicts, lists, tuples) with `fn` applied to every tensor in it."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


def _full(tree):
    """`tree` with every DTensor gathered into a whole tensor (a collective over its mesh)."""
    return _map_tensors(tree, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)


def _like(value, current):
    """A whole saved tensor laid out as `current` is: this rank's shard where `current` is a DTensor."""
    if isinstance(current, DTensor) and isinstance(value, torch.Tensor) and value.shape == current.shape:
        return distribute_tensor(value.to(current.device), current.device_mesh, current.placements)
    return value


def _to_cpu(tree):
    return _map_tensors(tree, lambda t: t.detach().cpu())
