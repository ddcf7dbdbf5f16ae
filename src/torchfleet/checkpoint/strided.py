"""Strided shards through torch.distributed.checkpoint: written and read as replicated tensors.

tp splits a packed projection (the experts' gate and up halves held in one tensor) as a strided shard, so each
rank holds its slice of both halves. DCP lays out a strided shard's chunks as if it were a plain shard: two
ranks' chunks then overlap and the save fails ("overlapping chunks"). Such entries are written replicated
instead (DCP writes a replicated tensor once, from one rank) and read the same way, then split back into the
strided shard each rank holds. The transient cost is one whole tensor per rank, one entry at a time on save.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor


def _is_strided(value) -> bool:
    return isinstance(value, DTensor) and any(type(p).__name__ == "_StridedShard" for p in value.placements)


def _replicated(value: DTensor) -> DTensor:
    """`value` with its strided dimensions replicated, its other placements kept."""
    placements = [Replicate() if type(p).__name__ == "_StridedShard" else p for p in value.placements]
    return DTensor.from_local(
        value.full_tensor(), value.device_mesh, [Replicate()] * value.device_mesh.ndim
    ).redistribute(value.device_mesh, placements)


def unstrided(state: dict) -> dict:
    """A copy of the (nested) `state` whose strided-shard entries are replicated; the rest the same objects."""
    return {
        key: unstrided(value) if isinstance(value, dict) else _replicated(value) if _is_strided(value) else value
        for key, value in state.items()
    }


@torch.no_grad()
def restrided(read: dict, original: dict) -> dict:
    """`read` (what DCP loaded into `unstrided(original)`) with each strided entry copied back into the
    original tensor, split as it was; the other entries as read (DCP replaces non-tensor values in place)."""
    out = {}
    for key, value in read.items():
        before = original.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            out[key] = restrided(value, before)
        elif isinstance(before, DTensor) and isinstance(value, DTensor) and _is_strided(before):
            whole = value.full_tensor()
            before.to_local().copy_(distribute_tensor(whole, before.device_mesh, before.placements).to_local())
            out[key] = before
        else:
            out[key] = value
    return out
