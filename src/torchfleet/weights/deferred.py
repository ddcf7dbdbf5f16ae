"""A model built on the meta device, given storage and values only where this process holds them.

`Fleet.setup` reads the model before any strategy has touched it: its tensors' names (`Recipe`), and a meta
copy of each module whose initialisation it may have to run, the same on every process. The strategy then
shards, splits or cuts the meta model as it would a real one (FSDP2, DTensor and the pipeline's cut all
work on meta tensors), and `materialise` gives each tensor this process holds its storage, in place (its
identity kept: optimizers, FSDP2 and a pipeline's grafted stages hold the same objects), and then its values:

- from a directory's files where a `LoadPlan` has them, this process's region only;
- else from the model's own initialisation, run module by module: a module's tensors made whole on the CPU,
  the transformers model's ``_init_weights`` (or the module's ``reset_parameters``, or peft's
  ``reset_lora_parameters`` for an adapter) run on them under a seed drawn from the module's name, and this
  process's region copied out. Every layout sees the same whole tensors, so serial, fsdp, tp and pipeline
  start from equal weights; the host holds this process's share plus one module's tensors whole, at most.
"""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchfleet.errors import UsageError
from torchfleet.strategies.blocks import library_model
from torchfleet.weights.files import mapping_allowed
from torchfleet.weights.keys import LoadPlan


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose tensors are on the meta device (ties kept): shapes, dtypes and modules, no storage."""
    memo: dict = {id(p): nn.Parameter(p.detach().to("meta"), p.requires_grad) for p in model.parameters()}
    memo.update({id(b): b.detach().to("meta") for b in model.buffers()})
    return copy.deepcopy(model, memo)


def region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, shape) of the part of the whole tensor this process holds: a DTensor's local shard, else all of it."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, start = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple(start), tuple(shape)
    return (0,) * tensor.dim(), tuple(tensor.shape)


def regions(tensor: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[slice, ...]]]:
    """(start, shape, where in the local tensor) of each block of the whole tensor this process holds. One block,
    but for a strided shard whose dimension nothing else splits: tp's split of experts whose gate and up halves
    are packed in one parameter (strategies/tp_styles.py) holds a slice of each half, `split_factor` blocks."""
    start, shape = region(tensor)
    everything = tuple(slice(None) for _ in shape)
    if not isinstance(tensor, DTensor):
        return [(start, shape, everything)]
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tensor.placements
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, _StridedShard) or any(q.is_shard(p.dim) for q in placements if q is not p):
            continue  # FSDP2's strided shard over a tp-split dimension holds one block
        dim, parts = p.dim % tensor.dim(), p.split_factor
        coordinate = tensor.device_mesh.get_coordinate()
        assert coordinate is not None
        chunk = tensor.shape[dim] // parts
        piece = chunk // tensor.device_mesh.size(mesh_dim)
        out = []
        for part in range(parts):
            at, size, local = list(start), list(shape), list(everything)
            at[dim], size[dim] = part * chunk + coordinate[mesh_dim] * piece, piece
            local[dim] = slice(part * piece, (part + 1) * piece)
            out.append((tuple(at), tuple(size), tuple(local)))
        return out
    return [(start, shape, everything)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_adapter_layer(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_lora_parameters", None)) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


@dataclass
class Unit:
    """A module whose initialisation makes some of the model's tensors: {path inside the module: tensor name}."""

    name: str
    module: nn.Module
    tensors: dict[str, str] = field(default_factory=dict)


class Recipe:
    """How each meta tensor of `model` gets its values when no file gives them: the model's units, each tensor
    made by the first unit holding it (transformers' initialisation skips a tied tensor made already), and
    every name a tensor goes by (its first name keys it). Taken before the strategy changes the model: each
    unit that `wanted` names a tensor of keeps a meta copy of its module (all of them without `wanted`)."""

    def __init__(self, model: nn.Module, seed: int, wanted: Callable[[str], bool] | None = None):
        self.seed = seed
        self.lib = library_model(model)  # its _init_weights reads its config alone, which no strategy changes
        self.peft_config = dict(getattr(model, "peft_config", None) or {})
        self.first: dict[str, str] = {}  # every name of a tensor -> its first name
        by_id: dict[int, str] = {}
        for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
            self.first[name] = by_id.setdefault(id(t), name)
        self.units: list[Unit] = []
        made: set[str] = set()
        inside_adapters: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(prefix) for prefix in inside_adapters):
                continue  # made by the adapter layer above it
            unit = Unit(name, module)
            if _is_adapter_layer(module):
                inside_adapters += [f"{name}.{child}." for child in module._modules if child.startswith("lora_")]
                held = [(p, t) for p, t in _tensors(module, recurse=True) if p.startswith("lora_")]
            else:
                held = list(_tensors(module))
            for path, _ in held:
                key = self.first[f"{name}.{path}" if name else path]
                if key not in made:
                    made.add(key)
                    unit.tensors[path] = key
            if unit.tensors and (wanted is None or any(wanted(key) for key in unit.tensors.values())):
                unit.module = skeleton(module)  # its own meta copy: the strategy may change the module itself
                self.units.append(unit)

    def values(self, unit: Unit) -> dict[str, torch.Tensor]:
        """{tensor name: its whole value}, the unit's own initialisation run on CPU copies under its seed."""
        module, lib = unit.module, self.lib
        adapter = _is_adapter_layer(module)
        paths = [
            p for p, _ in _tensors(module, recurse=adapter) if (p.startswith("lora_") if adapter else p in unit.tensors)
        ]
        memo: dict = {}
        owners = dict(_tensors(module, recurse=True))
        for path in paths:
            t = owners[path]
            fresh = torch.empty(t.shape, dtype=t.dtype)
            if fresh.is_floating_point():
                fresh.fill_(float("nan"))  # what no initialisation wrote shows as NaN below
            memo[id(t)] = nn.Parameter(fresh, t.requires_grad) if isinstance(t, nn.Parameter) else fresh
        whole: Any = copy.deepcopy(module, memo)  # peft's and transformers' methods, which nn.Module's typing hides
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed((self.seed * 1_000_003 + zlib.crc32(unit.name.encode())) % (2**63))
            if adapter:
                config = self.peft_config
                for name in (*whole.lora_A.keys(), *getattr(whole, "lora_embedding_A", {}).keys()):
                    whole.reset_lora_parameters(name, getattr(config.get(name), "init_lora_weights", True))
            elif callable(init_weights := getattr(lib, "_init_weights", None)):
                init_weights(whole)
            elif callable(getattr(whole, "reset_parameters", None)):
                whole.reset_parameters()
        got = dict(_tensors(whole, recurse=True))
        out = {}
        for path, key in unit.tensors.items():
            value = got[path].detach()
            if value.is_floating_point() and bool(value.isnan().any()):
                kind = type(module).__name__
                raise UsageError(
                    f"{key} ({kind}) has no initialisation to run on the meta device: {kind} has no reset_parameters"
                    " (nor does the model's _init_weights cover it); give it one, build that module outside"
                    " fleet.init_module(), or load its weights from a directory (weights=)"
                )
            out[key] = value
        return out


def _tensors(module: nn.Module, recurse: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=recurse, remove_duplicate=False)
    yield from module.named_buffers(recurse=recurse, remove_duplicate=False)


@contextlib.contextmanager
def _swapping():
    """Module._apply swaps each new tensor into the old object (torch.utils.swap_tensors), so whoever held a
    parameter (an optimizer, FSDP2, a pipeline's grafted stages) holds it with its storage after."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def give_storage(
    modules: Iterable[nn.Module], device: torch.device, given: dict[int, torch.Tensor] | None = None
) -> None:
    """Every meta tensor of `modules` given storage on `device`, in place: its tensor in `given` (by id) where it
    has one, else empty; real buffers moved there."""
    given = given or {}

    def storage(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t.to(device)
        return given[id(t)] if id(t) in given else torch.empty_like(t, device=device)

    with _swapping(), torch.no_grad():
        for module in modules:  # through FSDP2's _apply where it wraps: it re-points its sharded storage
            module._apply(storage)


def _evenly_split(tensor: torch.Tensor) -> bool:
    """Whether every process's share of `tensor` has the same shape (FSDP2 pads the last one otherwise, copying)."""
    if not isinstance(tensor, DTensor):
        return True
    from torch.distributed.tensor.placement_types import Replicate, Shard

    parts: dict[int, int] = {}
    for mesh_dim, p in enumerate(tensor.placements):
        if type(p) is Shard:
            parts[p.dim] = parts.get(p.dim, 1) * tensor.device_mesh.size(mesh_dim)
        elif not isinstance(p, Replicate):
            return False  # a strided or partial placement: read, not mapped
    return all(tensor.shape[dim] % n == 0 for dim, n in parts.items())


def mapped_share(tensor: torch.Tensor, name: str, plan: LoadPlan) -> torch.Tensor | None:
    """`tensor`'s share (a meta tensor, the model's `name`) as a tensor over the file's mapped bytes, a DTensor's
    laid out as the meta one: None where the share is not one run of one file's bytes in its dtype."""
    blocks = regions(tensor)
    if len(blocks) != 1 or not _evenly_split(tensor):
        return None
    start, shape, _ = blocks[0]
    if tuple(_local(tensor).shape) != shape:
        return None
    inside = [
        p
        for p in plan.pieces[name]
        if all(b >= a and b + m <= a + n for a, n, b, m in zip(p.start, p.shape, start, shape, strict=True))
    ]
    if len(inside) != 1:
        return None  # the share made of several pieces: experts stacked from one key each
    piece = inside[0]
    at = tuple(s - p for s, p in zip(start, piece.start, strict=True))
    at, size = (at[1:], shape[1:]) if piece.stacked else (at, shape)  # a stacked piece is one expert
    # A column split is mapped as a strided view where nothing wraps the DTensor further (tp alone, a 1-D mesh):
    # FSDP2 keeps its shards in flat storage of its own, and ep's experts in a mesh of theirs.
    columns = isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and not piece.stacked
    local = plan.sources[name].mapped(piece.key, at, size, tensor.dtype, columns=columns)
    if local is None:
        return None
    local = local.view(shape) if local.is_contiguous() else local
    if isinstance(tensor, DTensor):
        return DTensor.from_local(
            local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    return local


@torch.no_grad()
def materialise(
    modules: list[nn.Module], recipe: Recipe, device: torch.device, plan: LoadPlan | None = None
) -> list[str]:
    """Storage and values for the meta tensors `modules` hold (this process's share of the model);
    returns the names of the tensors initialised rather than loaded."""
    was_meta = [{name for name, t in _tensors(module, recurse=True) if t.is_meta} for module in modules]
    mapped: dict[int, torch.Tensor] = {}  # meta tensor's id -> its share over the file's mapped bytes
    if plan is not None and device.type == "cpu" and mapping_allowed():
        for module in modules:
            for name, t in _tensors(module, recurse=True):
                key = recipe.first.get(name)
                if t.is_meta and key in plan.pieces and id(t) not in mapped:
                    if (share := mapped_share(t, key, plan)) is not None:
                        mapped[id(t)] = share
    give_storage(modules, device, mapped)
    # A parameter keeps its identity (swapped), a buffer is replaced by the tensor given: either is done.
    done = set(mapped) | {id(share) for share in mapped.values()}
    local: dict[str, dict[int, torch.Tensor]] = {}  # tensor name -> this process's tensors of it (stages may share)
    for module, names in zip(modules, was_meta, strict=True):
        for name, t in _tensors(module, recurse=True):
            if name in names and name in recipe.first:
                local.setdefault(recipe.first[name], {})[id(t)] = t
    if plan is not None:
        for name, held in list(local.items()):
            if name in plan.pieces:
                for key, t in held.items():
                    if key not in done:
                        load(t, name, plan)
                del local[name]
    made = []
    for unit in recipe.units:
        wanted = [key for key in unit.tensors.values() if key in local]
        if not wanted:
            continue
        whole = recipe.values(unit)
        for key in wanted:
            for t in local[key].values():
                for start, shape, where in regions(t):
                    part = whole[key][tuple(slice(s, s + n) for s, n in zip(start, shape, strict=True))]
                    _local(t)[where].copy_(part)
            made.append(key)
    return made


@torch.no_grad()
def load(tensor: torch.Tensor, name: str, plan: LoadPlan) -> None:
    """This process's region of `tensor` (the model's `name`) read from the plan's files, piece by piece."""
    for start, shape, where in regions(tensor):
        _load_block(_local(tensor)[where], start, shape, name, plan)


def _load_block(target: torch.Tensor, start: tuple[int, ...], shape: tuple[int, ...], name: str, plan) -> None:
    """The block of the whole tensor `name` at `start` of `shape`, read into `target` piece by piece."""
    files = plan.sources[name]
    for piece in plan.pieces[name]:
        lo = [max(a, b) for a, b in zip(start, piece.start, strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(start, shape, piece.start, piece.shape, strict=True)]
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        inside = tuple(a - p for a, p in zip(lo, piece.start, strict=True))
        into = target[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start, strict=True))]
        into = into[0] if piece.stacked else into
        # Read on the host; a GPU's share goes over in one copy per piece (at most one tensor's share at once).
        host = into if into.device.type == "cpu" else torch.empty(into.shape, dtype=into.dtype)
        files.read_into(piece.key, inside[1:] if piece.stacked else inside, host)
        if host is not into:
            into.copy_(host)


def agreed_seed() -> int:
    """torch's seed on rank 0, the same on every rank: the initial weights are the job's, not each process's."""
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
    if dist.is_initialized():
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        seed = seed.to(device)
        dist.broadcast(seed, 0)
    return int(seed.item())
