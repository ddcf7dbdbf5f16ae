"""Tensors between pipeline stages outside a schedule, and whole states gathered from shards.

torch's schedules move activations during training; inference (`predict`)
and the full state on rank 0 move them here: a stage's outputs (one tensor,
or the tuple a traced stage returns) go point to point with a header giving
each tensor's shape and dtype, and tensor trees are gathered or laid out
again as DTensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 6


def send_tensors(tensors: tuple[torch.Tensor, ...], dst: int, device: torch.device) -> None:
    """Send a tuple of tensors: their count, then each one's header and data."""
    dist.send(torch.tensor([len(tensors)], dtype=torch.int64, device=device), dst)
    for tensor in tensors:
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header, dst)
        dist.send(tensor.contiguous(), dst)


def recv_tensors(src: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src)
    tensors = []
    for _ in range(int(count)):
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        dist.recv(header, src)
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
        dist.recv(tensor, src)
        tensors.append(tensor)
    return tuple(tensors)


def map_tensors(tree, fn):
    """`tree` (dicts, lists, tuples) with `fn` applied to every tensor in it."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree


def full(tree):
    """`tree` with every DTensor gathered into a whole tensor (a collective over its mesh)."""
    return map_tensors(tree, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)


def like(value, current):
    """A whole saved tensor laid out as `current` is: this rank's shard where `current` is a DTensor."""
    if isinstance(current, DTensor) and isinstance(value, torch.Tensor) and value.shape == current.shape:
        return distribute_tensor(value.to(current.device), current.device_mesh, current.placements)
    return value


def to_cpu(tree):
    return map_tensors(tree, lambda t: t.detach().cpu())
