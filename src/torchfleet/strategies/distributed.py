"""What every multi-process strategy shares: its parallel dimensions and the one mesh.

A multi-process strategy is a preset of degrees (strategies/dims.py); which
class runs it follows from the degrees, not the name: a pipeline dimension
means a schedule of micro-batches (`Pipeline`), sharding, tensor or expert
parallelism means DTensors and their state handling (`SplitParameters`),
replicas alone mean DDP (registry.MESH_CLASSES).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchfleet.errors import UsageError
from torchfleet.strategies.base import Strategy
from torchfleet.strategies.batchnorm import check_sync_batchnorm, convert_sync_batchnorm
from torchfleet.strategies.dims import DIM_NAMES, ParallelDims
from torchfleet.strategies.moe_balance import balance_over
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategies.registry import BORROWED_DIMS


def names_option(value) -> tuple[str, ...] | None:
    """ "a,b" or ["a", "b"] as a tuple of names; None or empty as None."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(item).strip() for item in items if str(item).strip())
    return names or None


class MeshStrategy(Strategy):
    distributed = True
    shards_alone = False  # a launcher's one process for it still shards (FSDP2 over a group of one)
    # --dp-replicate, --dp-shard, --pp, --tp, --sync-batchnorm: every preset takes them, and with
    # them the options of the dimensions they may add (the class follows from the degrees).
    # tp_plan (Python only): {module name: ParallelStyle} for a model without a tp_plan().
    takes = (*DIM_NAMES, *BORROWED_DIMS, "sync_batchnorm", "fsdp_units", "split_points", "tp_plan", "experts")

    def __init__(self, runtime, options: StrategyOptions | None = None, dims: ParallelDims | None = None):
        # The degrees come settled, in `dims` (strategy_spec.py resolves them once from `options.degrees`).
        options = options or StrategyOptions()
        super().__init__(runtime, options)
        sync_batchnorm, tp_plan = bool(options.replication.sync_batchnorm), options.tensor_parallel.tp_plan
        env = runtime.env
        assert dims is not None, "a mesh strategy is built with its degrees (StrategySpec.build)"
        check_sync_batchnorm(dims.pp, sync_batchnorm)
        if sync_batchnorm and dims.tp > 1:
            raise UsageError(
                f"--sync-batchnorm with tp({dims.tp}) is not supported: the ranks of a tensor-parallel"
                " group read the same batch, so all-reducing over every process would count it"
                f" {dims.tp} times; drop --sync-batchnorm, or --tp"
            )
        if tp_plan is not None and dims.tp == 1:
            raise UsageError(
                f"tp_plan applies where layers are split (tp, fsdp+tp, or --tp); {dims.name} has no tensor parallelism"
            )
        self.tp_plan = tp_plan
        self.sync_batchnorm = bool(sync_batchnorm)
        self.dims = dims
        self.fsdp_units = names_option(options.sharding.fsdp_units)
        self.split_points = names_option(options.pipeline.split_points)
        self.experts = names_option(options.experts.experts)
        if self.experts and dims.ep == 1:
            raise UsageError(
                f"--experts names what ep splits (ep, fsdp+ep, or --ep); {dims.name} does not split experts"
            )
        # One process that a launcher started for ddp or fsdp (Fleet keeps it a group of
        # one): the class wraps the model as at any size, which degrees of 1 would skip.
        self.alone = dims.world_size == 1
        if self.fsdp_units and dims.dp_shard == 1 and not (self.alone and self.shards_alone):
            raise UsageError(
                f"--fsdp-units applies where parameters are sharded (fsdp, hsdp, fsdp+pipeline);"
                f" {dims.name} does not shard them"
            )
        if self.split_points and dims.pp == 1:
            raise UsageError(
                f"--split-points cuts pipeline stages (pipeline, ddp+pipeline, fsdp+pipeline, mp); {dims.name} has none"
            )
        if not self.alone:
            self.name = dims.name  # the preset the degrees make ("ddp" with --pp 2 is ddp+pipeline)
        # The mesh is row-major: this rank's place is known before the mesh is built,
        # so a loader made before setup reads the right share.
        self.rank = env.rank
        self.coords = dims.coords(env.rank)
        self.mesh = None

    def synchronise_batchnorm(self, model: nn.Module) -> nn.Module:
        """With sync_batchnorm, `model`'s BatchNorm layers normalise with the whole batch's statistics.

        Without a pipeline every process is data-parallel (replicas, shards or
        both), so the statistics are all-reduced over all of them (WORLD).
        """
        return convert_sync_batchnorm(model, dist.group.WORLD) if self.sync_batchnorm else model

    def build_mesh(self):
        self.mesh = self.dims.build_mesh(self.runtime.device.type)
        return self.mesh

    def balance_router_loss(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """A transformers MoE model's load-balancing loss made the global batch's (strategies/moe_balance.py).

        Its expert counts are summed over the data-parallel dimensions of `mesh` (`build_mesh`'s).
        """
        groups = [mesh[name].get_group() for name in ("dp_replicate", "dp_shard") if getattr(self.dims, name) > 1]
        note = balance_over(model, groups)
        if note:
            self.notes.append(note)

    def data_coords(self) -> tuple[int, int]:
        return self.dims.dp_rank(self.rank), self.dims.dp
