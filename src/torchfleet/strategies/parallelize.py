"""One small function per parallelism, each applied over its dimension of the one mesh.

The multi-process strategies compose them in one fixed order (`parallelize`):

1. pipeline: cut the model into stages, keep this rank's (``pp``);
2. then the data-parallel dimensions on what is left:
   FSDP2 ``fully_shard`` over ``dp_shard`` (with ``dp_replicate`` too: HSDP,
   replicas of shards on FSDP2's 2-D mesh), or else DDP over ``dp_replicate``.

Sharding comes after the cut because FSDP2 shards the parameters a rank
holds, and after the cut a rank holds only its stage. Gradients are
synchronised by torch's own machinery in both cases; inside a pipeline,
torch's schedules drive it (DDP's reducer, FSDP2's post-backward) once per
schedule step, at the last micro-batch.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from torchfleet.errors import UsageError
from torchfleet.strategies.dims import ParallelDims
from torchfleet.strategies.partition import partition


def split_balanced(model: nn.Module, parts: int) -> list[tuple[int, int]]:
    """Cut `model`'s children into `parts` consecutive [start, end) ranges.

    Minimises the largest stage's parameter count; every stage gets at least
    one parameter (a stage of only activations would have nothing to train).
    The stages' parameters (not their compute) are balanced: that is what
    bounds each device's memory.
    """
    if not isinstance(model, nn.Sequential):
        raise UsageError(f"pipeline stages are cut from an nn.Sequential's children; got {type(model).__name__}")
    sizes = [sum(p.numel() for p in c.parameters()) for c in model]
    with_params = sum(1 for s in sizes if s)
    if with_params < parts:
        raise UsageError(f"the model has {with_params} layers with parameters, too few for {parts} stages;"
                         f" use at most {with_params} stages")
    bounds, start = [], 0
    for size in partition(sizes, parts, weighted_parts=True, ties_to_later=True):
        bounds.append((start, start + size))
        start += size
    return bounds


def apply_pipeline(model: nn.Module, pp: int, stage: int) -> tuple[nn.Sequential, list[tuple[int, int]]]:
    """This rank's stage of `model`, and every stage's [start, end) children.

    The stage keeps the Sequential's child names ("3.weight"), so the stages'
    state dicts together have the whole model's keys.
    """
    bounds = split_balanced(model, pp)
    start, end = bounds[stage]
    children = list(model.named_children())
    return nn.Sequential(OrderedDict(children[start:end])), bounds


def apply_autocast(module: nn.Module, precision) -> None:
    """Run `module`'s forward under the precision's autocast, through hooks.

    Hooks rather than a wrapper module, so parameter names stay the user's
    and DDP or FSDP2 can still wrap the module itself (torch's pipeline
    schedules look for them there). The schedule calls the module both for
    each micro-batch and for the first step's inference of activation shapes
    and dtypes, so the receive buffers are sized for what autocast produces.
    """
    if precision.name == "fp32":
        return
    active: list = []

    def enter(_module, _args):
        context = precision.autocast()
        context.__enter__()
        active.append(context)

    def leave(_module, _args, _output):
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)  # leave even when forward raises


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 on each child that holds parameters, then on the root.

    One all-gather per child keeps only one child's full parameters alive at
    a time; the root picks up parameters left directly on it. `mesh` is 1-D
    (shard over it) or 2-D (replicate over the first dimension, shard over
    the second: HSDP).
    """
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> DistributedDataParallel:
    """DDP over the mesh's one dimension: gradients averaged in buckets during backward."""
    # device_ids only for single-device CUDA modules; CPU modules take None.
    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=mesh.get_group())


def data_parallel_mesh(dims: ParallelDims, mesh: DeviceMesh) -> DeviceMesh:
    """The part of `mesh` FSDP2 works over: ("dp_replicate", "dp_shard") with replicas (HSDP), else "dp_shard"."""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
                precision, stage: int = 0):
    """Apply every parallelism of `dims`, in the fixed order; returns (module, runner, bounds).

    `module` is what this rank holds and trains (the stage, sharded or not);
    `runner` is what computes with it: DDP's wrapper around `module`, or
    `module` itself (FSDP2 shards in place). `bounds` is every pipeline stage's children (None
    without a pipeline).
    """
    bounds = None
    if dims.pp > 1:
        model, bounds = apply_pipeline(model, dims.pp, stage)
    model = model.to(device)
    if dims.pp > 1:
        apply_autocast(model, precision)  # a plain step enters autocast itself
    if dims.dp_shard > 1 or (dims.pp > 1 and dims.dp_replicate > 1):
        # Inside a pipeline, replicas too go through FSDP2 (a 2-D mesh whose shard
        # dimension is 1: replicate only). torch's schedules drive FSDP2's gradient
        # reduction themselves; DDP's reducer, driven the same way, failed its bucket
        # rebuild after the first step on torch 2.14 ("rebuilt parameter indices size
        # is not same as original model parameters size").
        model = apply_fsdp(model, data_parallel_mesh(dims, mesh))
        if dims.pp > 1:
            # A stage ending in a view (Flatten) makes FSDP2 warn on every step that an
            # in-place op on it would skip its hook; the schedule only sends it or takes
            # its loss, never writes into it.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return model, model, bounds
    if dims.dp_replicate > 1:
        return model, apply_ddp(model, mesh["dp_replicate"], device), bounds
    return model, model, bounds
