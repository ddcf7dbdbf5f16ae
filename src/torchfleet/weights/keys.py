"""Which keys of a directory's files hold each of the model's tensors, checked once for the whole model.

A transformers model's tensors are under its own state-dict keys (``model.layers.0.self_attn.q_proj.weight``);
under peft's wrapping the same keys are found by leaving out the wrapping (``base_model.model.``) and the
wrapped layer's name (``base_layer``), and the adapters under peft's names in an adapter directory. Where the
keys differ, in order: the user's `key_map` (model key -> file key), transformers' own renamings, and
experts that the files hold one per key and the model stacks in one tensor (transformers 5's MoE models:
``experts.3.gate_proj.weight`` and ``up_proj`` side by side in ``experts.gate_up_proj``). The check covers
every key both ways before any tensor is read, on every rank alike, so a bad directory stops every rank
with the same sentence and nothing half loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchfleet.errors import UsageError
from torchfleet.strategies.blocks import library_model
from torchfleet.weights.files import WeightFiles

KeyMap = Callable[[str], str | None] | Mapping[str, str]


@dataclass(frozen=True)
class Piece:
    """A file's tensor and the region of the model's tensor it fills."""

    key: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    stacked: bool = False  # the file holds it without the model tensor's first (expert) dimension


class Conversions:
    """transformers' conversions for a model that move whole tensors: renamings, and experts stacked
    (MergeModulelist, then Concatenate). Empty before transformers 5, whose models kept one module per expert."""

    def __init__(self, model: nn.Module, legacy: bool = True):
        self._model: Any = library_model(model)  # a transformers PreTrainedModel, which nn.Module's typing cannot say
        self._legacy = legacy
        self._read: tuple[list, list] | None = None

    def _transforms(self) -> tuple[list, list]:
        """(reversed renamings, (reversed converter, its source patterns, the concatenation's dimension or None)),
        read from transformers the first time a key is not found as it is (its table takes 0.4 s to build)."""
        if self._read is not None:
            return self._read
        self._read = renamings, experts = [], []
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
        except ImportError:
            return self._read
        if not hasattr(self._model, "config"):
            return self._read
        for transform in get_model_conversion_mapping(self._model, add_legacy=self._legacy):
            if isinstance(transform, WeightRenaming):
                renamings.append(transform.reverse_transform())
            elif isinstance(transform, WeightConverter):
                ops = list(transform.operations)
                if ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0:
                    if len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate)):
                        dim = getattr(ops[1], "dim") if len(ops) == 2 else None  # noqa: B009 (Concatenate's)
                        experts.append((transform.reverse_transform(), list(transform.source_patterns), dim))
        return self._read

    def renamed(self, key: str) -> str:
        for renaming in self._transforms()[0]:
            key, _ = renaming.rename_source_key(key)
        return key

    def expert_parts(self, key: str) -> tuple[list[str], int | None] | None:
        """The file keys (with ``*`` for the expert) a stacked model key is made of, and the dimension
        along which they are side by side; None where no conversion makes `key`."""
        for reverse, sources, dim in self._transforms()[1]:
            name, matched = reverse.rename_source_key(key)
            if matched is not None and sources[0] in name:
                return [name.replace(sources[0], source) for source in sources], dim
        return None


def model_keys(model: nn.Module) -> Callable[[str], tuple[str, bool]]:
    """name in `model` -> (the key a Hugging Face directory holds it under, whether it is an adapter's)."""
    inner = library_model(model)
    prefix = next((n for n, m in model.named_modules() if m is inner), "") if inner is not model else ""
    adapters = tuple(getattr(model, "peft_config", None) or ())

    def key(name: str) -> tuple[str, bool]:
        if any(f".lora_{part}" in name for part in ("A.", "B.", "embedding_A", "embedding_B", "magnitude")):
            for adapter in adapters:  # peft saves an adapter's tensors without its name
                name = name.replace(f".{adapter}.", ".").removesuffix(f".{adapter}")
            return name, True
        if prefix and name.startswith(prefix + "."):
            name = name[len(prefix) + 1 :]
        return name.replace(".base_layer.", "."), False

    return key


def _compatible(file: torch.dtype, model: torch.dtype) -> bool:
    return file == model or (file.is_floating_point and model.is_floating_point)


class LoadPlan:
    """{the model's tensor name: the pieces that fill it}, checked both ways against `files`
    (and `adapter_files`, a peft adapter directory) for the whole `model` (a meta copy will do)."""

    def __init__(
        self,
        model: nn.Module,
        files: WeightFiles,
        key_map: KeyMap | None = None,
        adapter_files: WeightFiles | None = None,
    ):
        self.files, self.adapter_files = files, adapter_files
        self.pieces: dict[str, list[Piece]] = {}
        self.sources: dict[str, WeightFiles] = {}
        conversions = Conversions(model)
        key_of = model_keys(model)
        used: set[str] = set()
        used_adapters: set[str] = set()
        persistent = set(model.state_dict(keep_vars=True))
        names: dict[int, list[str]] = {}
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for name, tensor in tensors:
            names.setdefault(id(tensor), []).append(name)
        self.first = {name: names[id(tensor)][0] for name, tensor in tensors}  # every name -> the tensor's first
        for name, tensor in tensors:
            if names[id(tensor)][0] != name or not any(n in persistent for n in names[id(tensor)]):
                continue  # an alias of a tensor already seen, or a buffer no state dict holds
            found = None
            for alias in names[id(tensor)]:
                key, adapter = key_of(alias)
                source = adapter_files if adapter else files
                if source is None:
                    break
                found = self._find(alias, key, tuple(tensor.shape), tensor.dtype, source, conversions, key_map)
                if found is not None:
                    self.pieces[name], self.sources[name] = found, source
                    (used_adapters if adapter else used).update(p.key for p in found)
                    # A tied tensor's other names (a head saved beside its embedding) are the model's keys too.
                    (used_adapters if adapter else used).update(key_of(n)[0] for n in names[id(tensor)])
                    break
            if found is None and not key_of(name)[1]:
                raise UsageError(
                    f"{files.directory} holds no weight for this model's {key_of(name)[0]}"
                    f" ({list(tensor.shape)}); give the directory of this model, or map its keys with key_map"
                )
        for source, taken in ((files, used), (adapter_files, used_adapters)):
            unknown = sorted(set(source.entries) - taken) if source is not None else []
            if source is not None and unknown:
                raise UsageError(
                    f"{source.directory} holds {unknown[0]}"
                    + (f" (and {len(unknown) - 1} more keys)" if len(unknown) > 1 else "")
                    + ", which this model does not have; give the directory of this model, or map its keys with key_map"
                )

    @staticmethod
    def _find(name, key, shape, dtype, files, conversions, key_map) -> list[Piece] | None:
        if key_map is not None:
            mapped = key_map.get(key) if isinstance(key_map, Mapping) else key_map(key)
            if mapped is not None:
                if mapped not in files.entries:
                    raise UsageError(f"key_map maps {key} to {mapped}, which {files.directory} does not hold")
                key = mapped
        candidate = key if key in files.entries else conversions.renamed(key)
        if candidate in files.entries:
            _check(files, candidate, shape, dtype, name)
            return [Piece(candidate, (0,) * len(shape), shape)]
        parts = conversions.expert_parts(key)
        if parts is None or not shape:
            return None
        patterns, dim = parts
        patterns = [p if p.replace("*", "0") in files.entries else conversions.renamed(p) for p in patterns]
        if any(p.replace("*", "0") not in files.entries for p in patterns):
            return None
        pieces, at = [], 0
        for pattern in patterns:
            part = files.entries[pattern.replace("*", "0")].shape
            offset = [0] * len(shape)
            if dim is not None:
                offset[dim] = at
                at += part[dim - 1]
            for expert in range(shape[0]):
                file_key = pattern.replace("*", str(expert))
                if file_key not in files.entries:
                    raise UsageError(f"{files.directory} holds no {file_key}, which this model's {name} stacks")
                _check(files, file_key, tuple(part), dtype, name)
                pieces.append(Piece(file_key, (expert, *offset[1:]), (1, *part), stacked=True))
        if (dim is not None and at != shape[dim]) or any(
            p.start[d] + p.shape[d] > shape[d] for p in pieces for d in range(len(shape))
        ):
            raise UsageError(f"{files.directory}'s experts do not make this model's {name} of shape {list(shape)}")
        return pieces


def _check(files: WeightFiles, key: str, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    entry = files.entries[key]
    if entry.shape != tuple(shape):
        raise UsageError(
            f"{files.directory} holds {key} of shape {list(entry.shape)} and this model's {name} is"
            f" {list(shape)}; give the directory of a model of this configuration"
        )
    if not _compatible(entry.dtype, dtype):
        raise UsageError(
            f"{files.directory} holds {key} as {entry.dtype} and this model's {name} is {dtype}, which cannot"
            " take it; give weights of a matching kind (floating point for floating point)"
        )
