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
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from torchfleet.strategies.distributed import MeshStrategy
from torchfleet.strategies.parallelize import parallelize


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def rebuild_optimizer(optimizer: torch.optim.Optimizer, old_names: dict[int, str],
                      model: nn.Module) -> torch.optim.Optimizer:
    """The same optimizer (class, param groups, hyper-parameters) over `model`'s current parameters.

    `old_names` maps id(old parameter) -> its name in `model`, taken before
    the parameters were replaced. Parameters `model` no longer holds (other
    pipeline stages') are left out; groups are kept, even empty, so every
    stage's optimizer has the same groups.
    """
    current = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        names = [old_names[id(p)] for p in group["params"]]
        groups.append({"params": [current[n] for n in names if n in current], **hyper})
    # Each group carries every hyper-parameter; the constructor gets those it
    # names (AdamW's defaults hold a key its __init__ does not take).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    new = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    new.defaults = dict(optimizer.defaults)
    return new


def memory_per_rank(params, grads, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes this rank holds, measured from its local tensors, gathered for every rank."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    mine = {"params": _nbytes(params), "grads": _nbytes(grads), "optimizer": _nbytes(state)}
    if not dist.is_initialized():
        return {"rank 0": mine}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {f"rank {r}": m for r, m in enumerate(every)}


class FullyShardedDataParallel(MeshStrategy):
    name = "fsdp"
    sharded_checkpoint = True  # each rank saves its own shards through torch.distributed.checkpoint

    def wrap(self, model, optimizer):
        old_names = {id(p): n for n, p in model.named_parameters()}
        self.model, _, _ = parallelize(model, self.dims, self.build_mesh(), self.runtime.device,
                                       self.runtime.precision)
        self.optimizer = rebuild_optimizer(optimizer, old_names, self.model)
        # fp16: each rank sees only its gradient shard, so overflow is agreed over all ranks.
        self.runtime.precision.sync_overflow(dist.group.WORLD)
        return self.model, self.optimizer

    @contextlib.contextmanager
    def no_sync(self):
        # Accumulate unsharded gradients locally; the next backward outside
        # reduce-scatters the sum.
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    _OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def state_dicts(self):
        """Full (unsharded) state on rank 0, empty dicts elsewhere; every rank must call it."""
        return get_state_dict(self.model, self.optimizer, options=self._OPTIONS)

    def load_state_dicts(self, model_state, optimizer_state):
        # Every rank passes the full state it read; each keeps its own shards.
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state,
                       optim_state_dict=optimizer_state,
                       options=StateDictOptions(full_state_dict=True))

    def memory_report(self):
        params = list(self.model.parameters())
        return memory_per_rank(params, [p.grad for p in params], self.optimizer)
