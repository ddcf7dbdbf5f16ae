"""What every multi-process strategy shares: its parallel dimensions and the one mesh.

A multi-process strategy is a preset of degrees (strategies/dims.py); which
class runs it follows from the degrees, not the name: a pipeline dimension
means a schedule of micro-batches (`Pipeline`), sharding means FSDP2's
state handling (`FullyShardedDataParallel`), replicas alone mean DDP.
"""

from __future__ import annotations

from torchfleet.strategies.base import Strategy
from torchfleet.strategies.dims import DIM_NAMES, ParallelDims


class MeshStrategy(Strategy):
    distributed = True
    options = DIM_NAMES  # --dp-replicate, --dp-shard, --pp: every preset takes them

    def __init__(self, runtime, dims: ParallelDims | None = None, dp_replicate: int | None = None,
                 dp_shard: int | None = None, pp: int | None = None, **options):
        super().__init__(runtime, **options)
        env = runtime.env
        if dims is None:
            dims = ParallelDims.from_preset(self.name, env.world_size, nodes=env.nnodes,
                                            dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp)
        self.dims = dims
        self.name = dims.name  # the preset the degrees make ("ddp" with --pp 2 is ddp+pipeline)
        # The mesh is row-major: this rank's place is known before the mesh is built,
        # so a loader made before setup reads the right share.
        self.rank = env.rank
        self.coords = dims.coords(env.rank)
        self.mesh = None

    def build_mesh(self):
        self.mesh = self.dims.build_mesh(self.runtime.device.type)
        return self.mesh

    def data_coords(self) -> tuple[int, int]:
        return self.dims.dp_rank(self.rank), self.dims.dp
