"""fsdp and hsdp: parameters, gradients and optimizer state sharded across processes (FSDP2).

fsdp is the preset ``dp_shard = N`` of the parallel dimensions; hsdp is
``dp_replicate = R, dp_shard = N / R``: FSDP2 on its 2-D mesh shards within
each group of N / R processes and averages gradients across the R groups
(replicate across machines, shard within one). `fully_shard` is applied to
each block that holds parameters (each child of the root), then to the root
(strategies/parallelize.py). Each
block's parameters are all-gathered just before its forward and freed after,
and its gradients are reduce-scattered during backward, so every rank holds
about 1/N of the training state between steps. The update is the same
computation as `serial`'s at the same global batch: each rank's gradient
shard is the average over ranks, and the optimizer steps its shard.

fully_shard replaces the module's parameters with DTensors, so the optimizer
given to `wrap` (built over the old tensors) is rebuilt over the new ones,
with its class, param groups and hyper-parameters kept.

Gloo: FSDP2 reduce-scatters gradients with ReduceOp.AVG and all-gathers
parameters; on torch 2.15 both run on Gloo and the CPU equivalence test
(weights equal serial's within 1e-5) shows the averaging is right, so CPU
runs need no workaround there. Mixed precision is the run's autocast, as for
every strategy: parameters and gradient reductions stay fp32.

This class runs tp and fsdp+tp too (strategies/tensor_parallel.py): tensor
parallelism also turns parameters into DTensors, which the same full state
dicts gather and scatter; FSDP2 is applied only where dp_shard or
dp_replicate is above 1.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchfleet.strategies.blocks import parameter_names
from torchfleet.strategies.distributed import MeshStrategy
from torchfleet.strategies.expert_parallel import check_experts, expert_note, find_experts
from torchfleet.strategies.parallelize import apply_fsdp, fsdp_units, parallelize
from torchfleet.strategies.tensor_parallel import clip_grad_norm, tp_plan_for


def _describe_units(model: nn.Module, units: list[list[nn.Module]]) -> str:
    if not units:
        return "no repeated blocks found; name their classes with --fsdp-units"
    names = {id(m): n for n, m in model.named_modules()}
    first, last = names[id(units[0][0])], names[id(units[-1][-1])]
    kinds = ", ".join(sorted({type(m).__name__ for unit in units for m in unit}))
    return f"{first}..{last}, {kinds}" if first != last else f"{first}, {kinds}"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, old_names: dict[int, list[str]], model: nn.Module
) -> torch.optim.Optimizer:
    """The same optimizer (class, param groups, hyper-parameters) over `model`'s current parameters.

    `old_names` maps id(old parameter) -> its names in `model`
    (`parameter_names`), taken before the parameters were replaced. A tied
    parameter is found under whichever of its names the stage kept.
    Parameters `model` no longer holds (other pipeline stages') are left out;
    groups are kept, even empty, so every stage's optimizer has the same groups.
    """
    current = dict(model.named_parameters(remove_duplicate=False))
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        found = [next((current[n] for n in old_names[id(p)] if n in current), None) for p in group["params"]]
        groups.append({"params": [p for p in found if p is not None], **hyper})
    # Each group carries every hyper-parameter; the constructor gets those it
    # names (AdamW's defaults hold a key its __init__ does not take).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    new = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    new.defaults = dict(optimizer.defaults)
    return new


def memory_per_rank(params, grads, optimizer: torch.optim.Optimizer, experts=()) -> dict:
    """Bytes this rank holds, measured from its local tensors, gathered for every rank; with `experts` (the
    parameters of the modules holding experts) also those of the parameters that are experts'."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    mine = {"params": _nbytes(params), "grads": _nbytes(grads), "optimizer": _nbytes(state)}
    if experts:
        mine["of which experts"] = _nbytes(experts)
    if not dist.is_initialized():
        return {"rank 0": mine}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {f"rank {r}": m for r, m in enumerate(every)}


class SplitParameters(MeshStrategy):
    """Runs every preset whose parameters are split across processes: FSDP2's shards, tensor parallelism's
    pieces, experts, or any of them together. All are DTensors, whose state this class gathers and scatters."""

    shards_alone = True
    sharded_checkpoint = True  # each rank saves its own shards through torch.distributed.checkpoint
    wraps_meta = True  # FSDP2, DTensor's split and the experts' shards all work on meta tensors

    def wrap(self, model, optimizer, args):
        model = self.synchronise_batchnorm(model)  # before sharding replaces the parameters
        old_names = parameter_names(model)
        plan = None
        if self.dims.tp > 1:  # checked before any collective: a bad plan stops every rank alike
            plan, source = tp_plan_for(model, self.dims.tp, self.tp_plan)
            self.notes.append(
                f"{self.name} splits {len(plan)} layers over tp({self.dims.tp}) processes"
                f" ({source}); each rank of a tp group holds the other layers whole"
            )
        experts = None
        if self.dims.ep > 1:
            experts = check_experts(model, self.dims.ep, self.experts)
            self.notes.append(expert_note(experts, self.dims))
        if self.dims.dp_shard > 1 or self.alone:
            units = fsdp_units(model, self.fsdp_units)
            self.notes.append(
                f"{self.name} shards {len(units)} units, one block each unless tied"
                f" ({_describe_units(model, units)}), then the root with the rest"
            )
        mesh = self.build_mesh()
        self.balance_router_loss(model, mesh)  # on the model's own forward, before sharding wraps it
        made = parallelize(
            model,
            dims=self.dims,
            mesh=mesh,
            device=self.runtime.device,
            precision=self.runtime.precision,
            fsdp_classes=self.fsdp_units,
            tp_plan=plan,
            experts=experts,
            expert_mesh=self.dims.build_expert_mesh(self.runtime.device.type) if experts else None,
        )
        self.model, self.step_contexts = made.module, made.step_contexts
        if self.alone:  # one shard, as FSDP2 runs on a group of one (parallelize shards from 2)
            apply_fsdp(self.model, mesh["dp_shard"], self.fsdp_units)
        self.optimizer = rebuild_optimizer(optimizer, old_names, self.model)
        if self.dims.tp > 1 and not isinstance(self.model, FSDPModule):
            # tp alone leaves the parameters outside the plan plain tensors beside the DTensors,
            # a mix torch's multi-tensor (foreach) kernels refuse; they are its default on CUDA.
            for group in self.optimizer.param_groups:
                if "foreach" in group:
                    group["foreach"] = False
        # fp16: each rank sees only its gradient shard, so overflow is agreed over all ranks.
        self.runtime.precision.sync_overflow(dist.group.WORLD)
        return self.model, self.optimizer

    @contextlib.contextmanager
    def no_sync(self):
        # Accumulate unsharded gradients locally; the next backward outside
        # reduce-scatters the sum. tp alone (no FSDP2) has no gradient sync to skip.
        if not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def clip_gradients(self):
        if self.dims.tp == 1 or self.runtime.max_grad_norm is None:
            return super().clip_gradients()  # one mesh's DTensors: torch's clip_grad_norm_
        self.runtime.precision.unscale(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return clip_grad_norm(params, self.runtime.max_grad_norm, self.runtime.device)

    _OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def state_dicts(self):
        """Full (unsharded) state on rank 0, empty dicts elsewhere; every rank must call it."""
        return get_state_dict(self.model, self.optimizer, options=self._OPTIONS)

    def load_state_dicts(self, model_state, optimizer_state):
        # Every rank passes the full state it read; each keeps its own shards.
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=self._by_name(optimizer_state),
            options=StateDictOptions(full_state_dict=True),
        )

    def _by_name(self, optimizer_state: dict) -> dict:
        """A full optimizer state keyed by parameter names, as torch's set_state_dict reads it. One that serial
        or ddp saved (torch.optim's own state_dict) numbers the parameters in the optimizer's order instead,
        the same order here: the model is the same and FSDP2 swaps each parameter for a DTensor in place."""
        if not any(isinstance(key, int) for key in optimizer_state.get("state", {})) and not any(
            isinstance(p, int) for g in optimizer_state.get("param_groups", ()) for p in g["params"]
        ):
            return optimizer_state
        name_of = {id(p): name for name, p in self.unwrapped().named_parameters()}
        names = [name_of[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        return {
            "state": {names[i]: entry for i, entry in optimizer_state["state"].items()},
            "param_groups": [
                {**group, "params": [names[i] for i in group["params"]]} for group in optimizer_state["param_groups"]
            ],
        }

    def memory_report(self):
        params = list(self.model.parameters())
        experts = [p for _, module in find_experts(self.model, self.experts) for p in module.parameters()]
        return memory_per_rank(params, [p.grad for p in params], self.optimizer, experts)
