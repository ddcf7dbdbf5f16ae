"""`save_model`: a transformers model as a Hugging Face directory written by every rank, other models as a state dict.

A transformers model given a directory (a path without .pt, .pth or .bin) is written as
`from_pretrained` reads it: safetensors files and their index, config.json, under the keys transformers'
own save_pretrained writes (experts one per key again, as the Hub holds them). No rank gathers the
model: each tensor is written by one of the ranks holding it, chosen to spread the bytes evenly, and a
sharded tensor is gathered whole only for the moment it is written (every rank of its mesh takes part,
one tensor at a time). Each writing rank writes its own file; the main rank writes the index and the
config. A peft model's base model goes to the directory and its adapters to ``adapter/`` in it, as
peft's save_pretrained writes them. Everything is written beside the directory first and renamed into
place, so a failed save leaves the previous one whole.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchfleet import checkpoint
from torchfleet.errors import UsageError
from torchfleet.strategies.blocks import library_model
from torchfleet.weights.files import INDEX, SINGLE, FileWriter
from torchfleet.weights.keys import Conversions, Piece, model_keys
from torchfleet.weights.start import held_modules

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin")  # a file of torch.save: save_model writes the state dict there
ADAPTER_DIR = "adapter"


class Pretrained:
    """What writing a transformers model's directory needs of the model, taken at setup (before any cut)."""

    def __init__(self, model: nn.Module):
        inner: Any = library_model(model)  # a transformers PreTrainedModel
        self.config = inner.config
        self.generation_config = getattr(inner, "generation_config", None)
        self.key_of = model_keys(model)
        self.conversions = Conversions(model, legacy=False)  # saved under today's names, as save_pretrained does

    @staticmethod
    def of(model: nn.Module) -> Pretrained | None:
        inner = library_model(model)
        config = getattr(inner, "config", None)
        return Pretrained(model) if callable(getattr(config, "save_pretrained", None)) else None

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[Piece]:
        """The file keys a model key is written under: itself renamed, or one per expert and part."""
        parts = self.conversions.expert_parts(key) if shape else None
        if parts is None:
            return [Piece(self.conversions.renamed(key), (0,) * len(shape), shape)]
        patterns, dim = parts
        step = shape[dim] // len(patterns) if dim is not None else 0
        pieces = []
        for j, pattern in enumerate(patterns):
            size = list(shape[1:])
            offset = [0] * len(shape)
            if dim is not None:
                size[dim - 1], offset[dim] = step, j * step
            for expert in range(shape[0]):
                file_key = self.conversions.renamed(pattern.replace("*", str(expert)))
                pieces.append(Piece(file_key, (expert, *offset[1:]), (1, *size), stacked=True))
        return pieces


def save_model(fleet, path: str | os.PathLike | None, adapters_only: bool, pretrained: Pretrained | None) -> Path:
    """Fleet.save_model's work: see its docstring."""
    strategy = fleet.strategy
    if path is None:
        if fleet.model_dir is None:
            raise UsageError(
                "save_model() needs a path outside a SageMaker job (inside one it writes model.pt to SM_MODEL_DIR)"
            )
        path = fleet.model_dir / ("adapters" if adapters_only else "model.pt")
    path = Path(str(path))
    if pretrained is not None and not adapters_only and path.suffix not in STATE_DICT_SUFFIXES:
        _in_place(fleet, path, lambda tmp: write_pretrained(strategy, pretrained, tmp, fleet.is_main))
        return path
    write = checkpoint.adapters.writer(strategy.adapters) if adapters_only else checkpoint.atomic_write
    state, _ = strategy.state_dicts()
    if fleet.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(state, path)
    fleet.barrier()
    return path


def _in_place(fleet, final: Path, write: Callable[[Path], None]) -> None:
    """`write` into a directory beside `final`, then renamed over it: a save that fails leaves the old one."""
    tmp = final.parent / f".{final.name}.partial"
    if fleet.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    fleet.barrier()
    try:
        write(tmp)
    except OSError as exc:
        raise UsageError(
            f"cannot write {str(final)!r} ({exc.strerror or exc}); what was there is untouched: free space or"
            " choose another path"
        ) from None
    fleet.barrier()
    if fleet.is_main:
        old = final.parent / f".{final.name}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    fleet.barrier()


def _entries(strategy, pretrained: Pretrained) -> list[tuple[str, torch.Tensor, bool]]:
    """(the model's name, tensor, whether an adapter's) of each tensor this process holds, once each."""
    own = getattr(strategy, "is_model_key", None)
    seen: set[int] = set()
    out = []
    for module in held_modules(strategy):
        for name, tensor in module.state_dict(keep_vars=True).items():
            if (own is not None and not own(name)) or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            out.append((name, tensor, pretrained.key_of(name)[1]))
    return out


def write_pretrained(strategy, pretrained: Pretrained, directory: Path, is_main: bool) -> None:
    """Every rank writes its share of the model into `directory` (collective)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    entries = _entries(strategy, pretrained)
    mine = [(pretrained.key_of(n)[0], tuple(t.shape), t.dtype, adapter) for n, t, adapter in entries]
    every: list[Any] = [mine]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, mine)
    holders: dict[str, list[int]] = {}
    described: dict[str, tuple[tuple[int, ...], torch.dtype, bool]] = {}
    for r, items in enumerate(every):
        for key, shape, dtype, adapter in items:
            holders.setdefault(key, []).append(r)
            described[key] = (shape, dtype, adapter)
    load, owner, adapter_owner = [0] * world, {}, {}
    for key, (shape, dtype, adapter) in described.items():  # each piece to the holder with the fewest bytes so far
        if adapter:
            adapter_owner[key] = holders[key][0]
            continue
        for piece in pretrained.pieces(key, shape):
            r = min(holders[key], key=lambda h: (load[h], h))
            owner[piece.key] = r
            load[r] += torch.empty(piece.shape, dtype=dtype, device="meta").nbytes
    writers = sorted(set(owner.values()))
    names = {
        r: SINGLE if len(writers) == 1 else f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors"
        for i, r in enumerate(writers)
    }
    plan = [
        (piece, tensor.dtype)
        for name, tensor, adapter in entries
        if not adapter
        for piece in pretrained.pieces(pretrained.key_of(name)[0], tuple(tensor.shape))
        if owner[piece.key] == rank
    ]
    writer = None
    if plan:
        shapes = [(p.key, dtype, p.shape[1:] if p.stacked else p.shape) for p, dtype in plan]
        writer = FileWriter(directory / names[rank], shapes)
    adapters: dict[str, torch.Tensor] = {}
    for name, tensor, adapter in entries:
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # a collective over its mesh
        if adapter:
            if adapter_owner[pretrained.key_of(name)[0]] == rank:
                adapters[name] = whole.detach().cpu()
            continue
        for piece in pretrained.pieces(pretrained.key_of(name)[0], tuple(tensor.shape)):
            if owner[piece.key] == rank and writer is not None:
                part = whole[tuple(slice(s, s + n) for s, n in zip(piece.start, piece.shape, strict=True))]
                writer.add(part[0] if piece.stacked else part)
    if writer is not None:
        writer.close()
    if dist.is_initialized():
        gathered: list = [None] * world
        dist.all_gather_object(gathered, adapters)  # adapters are small: the main rank writes them whole
        adapters = {k: v for part in gathered for k, v in part.items()}
    if is_main:
        if len(writers) > 1:
            index = {
                "metadata": {"total_size": sum(load)},
                "weight_map": dict(sorted((key, names[r]) for key, r in owner.items())),
            }
            (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        pretrained.config.save_pretrained(directory)
        if pretrained.generation_config is not None:
            pretrained.generation_config.save_pretrained(directory)
        skeleton: Any = strategy.adapters  # peft's PeftModel on the meta device (strategies/blocks.adapter_skeleton)
        if adapters and skeleton is not None:
            skeleton.save_pretrained(str(directory / ADAPTER_DIR), state_dict=adapters)
