"""A model's repeated blocks: the units that sharding, checkpointing, compiling and cutting work on.

Transformers keep their layers in an ``nn.ModuleList`` (GPT-2's
``transformer.h``, Llama's ``model.layers``); ResNets keep theirs in
``nn.Sequential`` stages of residual blocks. The blocks are what every
parallelism wants as its unit: FSDP gathers one block's parameters at a time,
activation checkpointing recomputes one block, a pipeline cuts between two.
The root's other children (embeddings, final norm, head) are left to the
root's own unit.
"""

from __future__ import annotations

import copy
from collections import Counter

from torch import nn

from torchfleet.errors import UsageError


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name `model` holds it under (a tied parameter has several)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def on_meta(model: nn.Module) -> bool:
    """Whether `model` holds tensors on the meta device (built without storage, weights/deferred.py gives it)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def library_model(model: nn.Module) -> nn.Module:
    """The transformers model inside `model`: `model` itself, or the one peft's wrapping holds.

    peft's PeftModel (and the LoraModel under it) forward to the model they adapt, which keeps its
    config and its plans; its `base_model` is peft's LoraModel, not the transformers base model.
    """
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and hasattr(model, "peft_config"):
        inner = get_base_model()
        if isinstance(inner, nn.Module):
            return inner
    return model


def adapter_skeleton(model: nn.Module) -> nn.Module | None:
    """A copy of a peft-adapted `model` whose tensors are on the meta device (no storage); None without adapters.

    Taken before a strategy shards or cuts the model: after, no rank holds the whole model
    that peft's save_pretrained walks to pick its adapters' keys (checkpoint/adapters.py).
    """
    if not (hasattr(model, "peft_config") and callable(getattr(model, "save_pretrained", None))):
        return None
    # deepcopy takes each parameter and buffer from the memo: the copy gets storage-free twins, tied ones tied still
    memo: dict = {id(p): nn.Parameter(p.to("meta"), p.requires_grad) for p in model.parameters()}
    memo.update({id(b): b.to("meta") for b in model.buffers()})
    return copy.deepcopy(model, memo)


def base_model(model: nn.Module) -> nn.Module:
    """The transformers base model (Llama's LlamaModel) that declared plans are written over."""
    inner = library_model(model)
    return getattr(inner, "base_model", inner)


def on_base_model(model: nn.Module, plan: dict) -> dict:
    """A transformers base-model plan with its keys named in `model`.

    Configs declare plans over the base model's modules (``layers.*.mlp``); in a task model
    they sit under the base model's name (``model.layers.*.mlp`` in LlamaForCausalLM), and under
    peft's wrapping further down (``base_model.model.model.layers.*.mlp``).
    """
    return under(model, base_model(model), plan)


def under(model: nn.Module, inner: nn.Module, plan: dict) -> dict:
    """`plan`, written over `inner`, with its keys named in `model`."""
    prefix = next((name for name, m in model.named_modules() if m is inner), "")
    return {(f"{prefix}.{key}" if prefix else key): value for key, value in plan.items()}


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, classes: tuple[str, ...] | None = None) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each of `model`'s repeated blocks, in forward order.

    With `classes` (class names such as ``GPT2Block``): every module of those
    classes, outermost only. Without: the children of the model's largest
    container (``nn.ModuleList``, or ``nn.Sequential`` that is not the root),
    by parameters, whose children are mostly of one class; when the largest
    is a ResNet's stage, every stage of the same kind counts (layer1..layer4).
    An ``nn.Sequential`` root's own children are its blocks. Empty when the
    model has no repeated blocks.
    """
    if classes:
        found, taken = [], []
        for name, module in model.named_modules():
            if type(module).__name__ in classes and not any(name.startswith(t + ".") for t in taken):
                found.append((name, module))
                taken.append(name)
        if not found:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise UsageError(
                f"fsdp_units {', '.join(classes)} names no module class of this model;"
                f" its classes are {', '.join(present)}"
            )
        return found
    if isinstance(model, nn.Sequential):
        return [(name, child) for name, child in model.named_children() if _params(child)]
    containers = []
    for name, module in model.named_modules():
        if name and isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            kinds = Counter(type(child).__name__ for child in module)
            kind, count = kinds.most_common(1)[0]
            if count * 2 >= len(module) and _params(module):
                containers.append((_params(module), name, kind))
    if not containers:
        return []
    _, biggest, kind = max(containers)
    # A ResNet's stages are Sequentials of the same block class; take them all,
    # outermost first, so layer1..layer4 are cut and sharded alike.
    chosen = [name for _, name, k in containers if k == kind]
    chosen = [n for n in chosen if not any(n.startswith(o + ".") for o in chosen if o != n)]
    if biggest not in chosen:
        chosen = [biggest]
    blocks = []
    for container in chosen:
        for child_name, child in model.get_submodule(container).named_children():
            if _params(child):
                blocks.append((f"{container}.{child_name}", child))
    return blocks


def describe(blocks: list[tuple[str, nn.Module]]) -> str:
    """`transformer.h.0`..`transformer.h.11` (12 GPT2Block) for a summary line."""
    if not blocks:
        return "none"
    kinds = Counter(type(m).__name__ for _, m in blocks)
    what = ", ".join(f"{n} {k}" for k, n in kinds.items())
    span = blocks[0][0] if len(blocks) == 1 else f"{blocks[0][0]}..{blocks[-1][0]}"
    return f"{span} ({what})"
