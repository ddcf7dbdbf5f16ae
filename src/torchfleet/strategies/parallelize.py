"""One small function per parallelism, each applied over its dimension of the one mesh.

The multi-process strategies compose them in one fixed order (`parallelize`):

1. pipeline: cut the model into stages, keep this rank's (``pp``);
2. or tensor parallelism: split the layers of the model's plan over ``tp``
   (strategies/tensor_parallel.py; not yet inside pipeline stages);
   and expert parallelism: split the experts (each as tp left it) over ``ep``
   (strategies/expert_parallel.py), then FSDP2 on each experts' module over the
   experts' mesh ("dp_mod_ep"), before its block's;
3. then the data-parallel dimensions on what is left:
   FSDP2 ``fully_shard`` over ``dp_shard`` (with ``dp_replicate`` too: HSDP,
   replicas of shards on FSDP2's 2-D mesh), or else DDP over ``dp_replicate``.

Sharding comes after the cut because FSDP2 shards the parameters a rank
holds, and after the cut a rank holds only its stage; after tensor
parallelism for the same reason, as torchtitan orders them: FSDP2 shards the
tp-split parameters (DTensors on the "tp" dimension) further over
``dp_shard``, a 2-D mesh of the same parent. Gradients are
synchronised by torch's own machinery in both cases; inside a pipeline,
torch's schedules drive it (DDP's reducer, FSDP2's post-backward) once per
schedule step, at the last micro-batch.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from torchfleet.errors import UsageError
from torchfleet.strategies.blocks import find_blocks, on_meta
from torchfleet.strategies.dims import ParallelDims
from torchfleet.strategies.expert_parallel import apply_ep
from torchfleet.strategies.partition import partition
from torchfleet.strategies.registry import DIM, DIM_NAMES, DP_REPLICATE, DP_SHARD, TP, class_path
from torchfleet.strategies.tensor_parallel import apply_tp

# What a declared dimension's parallelism enters around each step: called with the step's inputs and targets.
StepContext = Callable[..., AbstractContextManager]


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
        raise UsageError(
            f"the model has {with_params} layers with parameters, too few for {parts} stages;"
            f" use at most {with_params} stages"
        )
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


def fsdp_units(model: nn.Module, classes: tuple[str, ...] | None = None) -> list[list[nn.Module]]:
    """The modules FSDP2 shards as units, before the root: the model's repeated blocks.

    Blocks that share a parameter (tied weights) form one unit: FSDP2 needs
    every user of a parameter inside the unit that owns it. A block sharing
    one with a module outside every block (an embedding tied to a head on
    the root) is left to the root's unit for the same reason.
    """
    named = find_blocks(model, classes)
    blocks = [module for _, module in named]
    prefixes = tuple(name + "." for name, _ in named)
    holders: dict[int, set[int | None]] = {}  # parameter -> the blocks that use it (None: no block)
    with_root: set[int] = set()  # blocks sharing a parameter with a module in no block
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), None)
        holders.setdefault(id(p), set()).add(owner)
    group = list(range(len(blocks)))  # union-find: blocks sharing a parameter are one unit

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for owners in holders.values():
        inside = sorted(i for i in owners if i is not None)
        if None in owners:
            with_root.update(inside)
        for other in inside[1:]:
            group[root(other)] = root(inside[0])
    left_to_root = {root(i) for i in with_root}
    units: dict[int, list[nn.Module]] = {}
    for i, block in enumerate(blocks):
        if root(i) not in left_to_root and any(p.requires_grad for p in block.parameters()):
            units.setdefault(root(i), []).append(block)
    return list(units.values())


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, classes: tuple[str, ...] | None = None, pipelined: bool = False
) -> list[list[nn.Module]]:
    """FSDP2 on each of the model's repeated blocks (`fsdp_units`), then on the root; returns the units.

    One all-gather per block keeps only one block's full parameters alive at
    a time; the root's unit holds what no block does (embeddings, final norm,
    head). `mesh` is 1-D (shard over it) or 2-D (replicate over the first
    dimension, shard over the second: HSDP).
    """
    units = fsdp_units(model, classes)
    for i, unit in enumerate(units):
        # torchtitan's choice: the last block's parameters stay gathered from its forward to its backward,
        # which comes next, instead of being freed and gathered again; inside a pipeline every block's do,
        # as a schedule runs forward and backward once per micro-batch (one gather per step, not per
        # micro-batch). The root keeps FSDP2's own default (gathered, for the same reason as the last block).
        # It beat FSDP2's defaults on gpt at two sizes, where prefetching 2 units and units of 2 blocks did not
        # on both (benchmarks/decompose.py; docs/benchmarks/history.md, "Where fsdp's and the pipeline's step goes").
        keep = pipelined or i == len(units) - 1
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh)
    return units


def apply_ddp(
    model: nn.Module, mesh: DeviceMesh, device: torch.device, find_unused_parameters: bool = False
) -> DistributedDataParallel:
    """DDP over the mesh's one dimension: gradients averaged in buckets during backward.

    `find_unused_parameters` walks the autograd graph after each forward to
    mark parameters it will not reach as ready (a cost every step): needed
    only when the forward leaves some parameters unused.
    """
    # device_ids only for single-device CUDA modules; CPU modules take None.
    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(
        model, device_ids=ids, process_group=mesh.get_group(), find_unused_parameters=find_unused_parameters
    )


def fsdp_dims(dims: ParallelDims) -> tuple[str, ...]:
    """The dimensions FSDP2 shards over: dp_shard, with every other declared `sharded_over` whose degree is above 1."""
    return (DP_SHARD, *(n for n in DIM_NAMES if DIM[n].sharded_over and dims.degrees[n] > 1))


def data_parallel_mesh(dims: ParallelDims, mesh: DeviceMesh) -> DeviceMesh:
    """The part of `mesh` FSDP2 works over: the shard dimensions (`fsdp_dims`, flattened into one where there are
    several, as torchtitan's dp_shard_cp), with "dp_replicate" before them where there are replicas (HSDP)."""
    over = fsdp_dims(dims)
    shard = DP_SHARD
    if len(over) > 1:
        shard = "_".join(over)
        mesh[over]._flatten(shard)  # registered on the root mesh, so it can be sliced beside dp_replicate
    if dims.dp_replicate > 1:
        return mesh[DP_REPLICATE, shard]
    return mesh[shard]


def apply_declared(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh) -> tuple[StepContext, ...]:
    """Each dimension's own parallelism, where its declaration names the function that applies it (`Dim.applies`),
    in the mesh's order; returns what each asks to enter around every step's forward and backward."""
    contexts = []
    for name in DIM_NAMES:
        where = DIM[name].applies
        if where is None or dims.degrees[name] == 1:
            continue
        if dims.pp > 1:  # a pipeline's schedule runs the steps itself, and enters nothing of theirs
            raise UsageError(f"{name}({dims.degrees[name]}) beside pipeline stages is not supported yet; drop --pp")
        module, function = class_path(where).split(":")
        context = getattr(importlib.import_module(module), function)(model, mesh[name], dims)
        if context is not None:
            contexts.append(context)
    return tuple(contexts)


class Parallelized(NamedTuple):
    """What `parallelize` made of a model on this rank."""

    module: nn.Module  # what this rank holds and trains: the model, or its stage; sharded or not
    runner: nn.Module  # what computes with it: DDP's wrapper around `module`, or `module` (FSDP2 shards in place)
    bounds: list[tuple[int, int]] | None  # every pipeline stage's children: a Sequential cut by children only
    # entered around each step's forward and backward, as `context(inputs, targets)`: what a declared dimension's
    # parallelism asked for (`apply_declared`)
    step_contexts: tuple[StepContext, ...] = ()


def parallelize(
    model: nn.Module,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    precision,
    stage: int = 0,
    cut_stage: nn.Module | None = None,
    fsdp_classes: tuple[str, ...] | None = None,
    find_unused_parameters: bool = False,
    tp_plan: dict | None = None,
    experts: list[tuple[str, nn.Module]] | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> Parallelized:
    """Apply every parallelism of `dims` to `model`, in the fixed order.

    `cut_stage` is this rank's stage when the pipeline cut the model itself (by tracing it,
    strategies/pipeline/cutting.py, or by its own plan, strategies/pipeline/declared_cut.py);
    a Sequential is cut here, by its children.
    `fsdp_classes` names the block classes FSDP2 shards as units (default: the repeated blocks).
    `tp_plan` is the tensor-parallel plan (`tensor_parallel.tp_plan_for`), needed when ``dims.tp > 1``;
    `experts` (`expert_parallel.check_experts`) and `expert_mesh` (`dims.build_expert_mesh`) when ``dims.ep > 1``.
    """
    bounds = None
    if cut_stage is not None:
        model = cut_stage
    elif dims.pp > 1:
        model, bounds = apply_pipeline(model, dims.pp, stage)
    if not on_meta(model):  # a meta model is given its storage after, each rank only its share
        model = model.to(device)
    if dims.pp > 1:
        apply_autocast(model, precision)  # a plain step enters autocast itself
    if dims.tp > 1:
        assert tp_plan is not None, "parallelize: dims.tp > 1 needs tp_plan"
        apply_tp(model, mesh[TP], tp_plan)
    if dims.ep > 1:
        assert experts and expert_mesh is not None, "parallelize: dims.ep > 1 needs experts and expert_mesh"
        apply_ep(experts, expert_mesh)
        for _, module in experts:  # their own units first, so their blocks' units leave them out
            fully_shard(module, mesh=expert_mesh["dp_mod_ep"])
    contexts = apply_declared(model, dims, mesh)
    sharded = math.prod(dims.degrees[n] for n in fsdp_dims(dims)) > 1
    beside = any(degree > 1 for name, degree in dims.degrees.items() if name != DP_REPLICATE)
    if sharded or (beside and dims.dp_replicate > 1):
        # Inside a pipeline or beside tp or ep, replicas too go through FSDP2 (a 2-D mesh whose
        # shard dimension is 1: replicate only). Beside tp, FSDP2 averages the tp-split
        # DTensor gradients over their mesh's other dimension (torchtitan, too, refuses
        # DDP beside another dimension). Inside a pipeline, torch's schedules drive FSDP2's
        # gradient reduction themselves; DDP's reducer, driven the same way, failed its bucket
        # rebuild after the first step on torch 2.14 ("rebuilt parameter indices size
        # is not same as original model parameters size").
        apply_fsdp(model, data_parallel_mesh(dims, mesh), fsdp_classes, pipelined=dims.pp > 1)
        if dims.pp > 1:
            # A stage ending in a view (Flatten) makes FSDP2 warn on every step that an
            # in-place op on it would skip its hook; the schedule only sends it or takes
            # its loss, never writes into it.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return Parallelized(model, model, bounds, contexts)
    if dims.dp_replicate > 1:
        runner = apply_ddp(model, mesh[DP_REPLICATE], device, find_unused_parameters)
        return Parallelized(model, runner, bounds, contexts)
    return Parallelized(model, model, bounds, contexts)
