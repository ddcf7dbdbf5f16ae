"""ddp+pipeline: a 2-D mesh ("dp", "pp"), pipeline stages inside each replica, DDP across replicas.

Ranks are laid out replica-major: with 4 processes and ``pp=2``, ranks 0-1
are replica 0's stages 0-1 and ranks 2-3 replica 1's. Each replica reads its
own slice of the global batch and runs it through its pipeline; then each
stage averages its gradients with the same stage of the other replicas over
the "dp" sub-group, in one coalesced all-reduce. An explicit all-reduce after
the schedule, rather than DDP inside it, reduces once per step however many
micro-batch backwards the schedule ran.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from torchfleet.errors import UsageError
from torchfleet.strategies.pipeline import Pipeline


def mesh_shape(world_size: int, pp: int) -> tuple[int, int]:
    """(dp, pp) for `world_size` processes: the one place the mesh arithmetic is checked."""
    if pp < 2:
        raise UsageError(f"--pp {pp} must be at least 2 (one stage per replica is plain ddp)")
    dp = max(1, world_size // pp)
    if pp * dp != world_size:
        raise UsageError(f"pp({pp}) * dp({dp}) != world_size({world_size}); use a --pp that divides"
                         f" the {world_size} processes")
    return dp, pp


class DdpPipeline(Pipeline):
    name = "ddp+pipeline"
    options = ("pp", "microbatches", "schedule")

    def __init__(self, runtime, pp: int = 2, **options):
        self.pp_option = pp
        super().__init__(runtime, **options)

    @classmethod
    def data_readers(cls, world_size: int, pp: int = 2, **options) -> int:
        return mesh_shape(world_size, pp)[0]  # one reader per replica

    def mesh_shape(self, world_size):
        return mesh_shape(world_size, self.pp_option)

    def sync_gradients(self) -> None:
        if self.dp == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)



