"""tp: tensor parallelism, each layer of the model's plan split across one "tp" group of processes.

A plan maps module names to torch.distributed.tensor.parallel's styles:
``ColwiseParallel`` splits an ``nn.Linear``'s output features (each rank
computes its slice of the outputs from the whole input), ``RowwiseParallel``
its input features (each rank a partial sum of every output, all-reduced).
Megatron's pairing, column-wise then row-wise (q/k/v then the attention's
output projection, the MLP's fc then its projection), keeps the activation
between the two split and costs one all-reduce per pair in forward and one
in backward. The plan comes from the user (strategy option ``tp_plan=``), or
from the model: a ``tp_plan()`` method (the built-in gpt has one), or the
``base_model_tp_plan`` a transformers config declares (Llama and most decoder
families), its words mapped to torch's styles by tp_styles.py.

Why the weights equal serial's: a column-wise layer's outputs are serial's
dot products, computed by whichever rank holds those columns; a row-wise
layer's outputs are serial's sums, added in another order (float rounding,
about 1e-7). Every rank of a tp group reads the same batch (`ParallelDims.dp`
leaves tp out), and the layers outside the plan (embeddings, norms, head)
stay plain tensors that every rank of the group computes alike: the
gradient reaching them is all-reduced by the column-wise layers' backward,
so their gradients and updates are equal on every rank of the group without
further communication.
"""

from __future__ import annotations

import inspect
import math
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from torchfleet.errors import UsageError
from torchfleet.strategies.blocks import on_base_model
from torchfleet.strategies.tp_styles import ExpertsSplit, library_styles

PLAN_HINT = (
    "give the strategy option tp_plan={module name: ColwiseParallel() or RowwiseParallel(), ...}"
    " (torch.distributed.tensor.parallel), or add a tp_plan() method to the model that returns one"
    " (a transformers model's config may declare base_model_tp_plan)"
)


def tp_plan_for(model: nn.Module, tp: int, given: dict | None = None) -> tuple[dict[str, ParallelStyle], str]:
    """(the plan for `tp` ranks, where it came from): `given` if any, else the model's `tp_plan()`,
    else a transformers config's ``base_model_tp_plan`` (`declared_tp_plan`).

    A model's `tp_plan` may take the degree (``tp_plan(tp)``) to check its
    shape against it: the built-in gpt refuses a tp that splits a head.
    Every name must match a module of `model` (``*`` matches any part, as in
    torch's plans); torch would only warn and skip the layer.
    """
    kind = type(model).__name__
    if given is not None:
        plan, source = dict(given), "the tp_plan option"
    elif callable(getattr(model, "tp_plan", None)):
        method: Any = model.tp_plan  # a method of the model's class; nn.Module's __getattr__ says Tensor | Module
        plan = method(tp=tp) if "tp" in inspect.signature(method).parameters else method()
        plan, source = dict(plan), f"{kind}.tp_plan()"
    elif getattr(getattr(model, "config", None), "base_model_tp_plan", None):
        plan, source = declared_tp_plan(model, tp), f"{kind}'s own base_model_tp_plan (transformers)"
    else:
        raise UsageError(f"tensor parallelism needs a plan of which layers to split, and {kind} has none; " + PLAN_HINT)
    if not plan:
        raise UsageError(f"{source} is empty, so tensor parallelism would split nothing; " + PLAN_HINT)
    names = [name for name, _ in model.named_modules()]
    if source.endswith("(transformers)"):
        # A family's plan names every kind of layer it may have (Qwen3-MoE's dense MLPs, for the layers a config
        # keeps dense); transformers splits the ones a model has, and so does torchfleet.
        plan = {key: style for key, style in plan.items() if any(fnmatchcase(name, key) for name in names)}
    plan = through_adapters(model, plan, source)
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise UsageError(
                f"{source} maps {key!r} to {type(style).__name__}, not a ParallelStyle"
                " (ColwiseParallel, RowwiseParallel, ... from torch.distributed.tensor.parallel)"
            )
        if not any(fnmatchcase(name, key) for name in names):
            raise UsageError(f"{source} names {key!r}, which is not a module of this {kind}")
    return plan, source


def _is_adapter(module: nn.Module) -> bool:
    """A layer one of peft's adapters wraps: the original layer as `base_layer`, the adapter's tensors beside it."""
    return isinstance(getattr(module, "base_layer", None), nn.Module)


def adapter_kind(module: nn.Module) -> str:
    """The peft adapter on a wrapped layer: "LoRA", "DoRA" (LoRA with a magnitude vector), "IA3", "LoHa", ..."""
    if all(isinstance(getattr(module, n, None), nn.Module) for n in ("lora_A", "lora_B")):
        magnitude = getattr(module, "lora_magnitude_vector", None)
        return "DoRA" if magnitude is not None and len(magnitude) else "LoRA"
    tuner = type(module).__module__.split(".")  # peft.tuners.<kind>.layer
    names = {"ia3": "IA3", "loha": "LoHa", "lokr": "LoKr", "oft": "OFT", "boft": "BOFT", "vera": "VeRA"}
    return names.get(tuner[2], tuner[2]) if len(tuner) > 2 and tuner[0] == "peft" else type(module).__name__


def through_adapters(model: nn.Module, plan: dict[str, ParallelStyle], source: str) -> dict[str, ParallelStyle]:
    """`plan` with each layer peft's LoRA wraps split as the layer and its adapter together.

    The wrapped layer (`base_layer`) takes the plan's style. Its adapter adds ``B(A(x))``: beside a
    column-wise layer B is split by columns too (its output joins the layer's shard) and A stays
    whole; beside a row-wise layer A is split by rows (it reads the layer's shard of the input and
    its output is summed over the group) and B stays whole. The whole ones get equal gradients on
    every rank of the group, as the embeddings do.
    """
    modules = list(model.named_modules())
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        matched = [m for name, m in modules if fnmatchcase(name, key)]
        adapters = [m for m in matched if _is_adapter(m)]
        if not adapters:
            out[key] = style
            continue
        if len(adapters) != len(matched):
            raise UsageError(
                f"{source} names {key!r}, which matches layers with adapters and layers without; name them apart"
            )
        kind = adapter_kind(adapters[0])
        if kind != "LoRA":
            raise UsageError(
                f"{source} splits {key!r}, which carries a {kind} adapter; tp splits layers with LoRA adapters only"
                f" (a {kind} adapter's tensors span the layer's whole width), and ddp, fsdp, hsdp and pipeline take"
                f" {kind} adapters: use one of those"
            )
        out[f"{key}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            out[f"{key}.lora_B.*"] = ColwiseParallel()
        elif isinstance(style, RowwiseParallel):
            out[f"{key}.lora_A.*"] = RowwiseParallel()
        else:
            raise UsageError(
                f"{source} splits {key!r}, which carries an adapter, with {type(style).__name__}; torchfleet splits"
                " an adapter beside a column-wise or a row-wise layer only: leave the adapter off that layer"
            )
    return out


def declared_tp_plan(model: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    """A transformers model's own plan (its config's ``base_model_tp_plan``) as torch's styles.

    Its keys name the base model's modules (``layers.*.self_attn.q_proj``); prefixed here with
    the base model's name in `model` (``model.`` in LlamaForCausalLM). The embeddings and the
    head, which the plan leaves out, stay whole on every rank of the group.
    """
    kind = type(model).__name__
    config = getattr(model, "config", None)
    styles = library_styles(dict(getattr(config, "base_model_tp_plan", None) or {}), config, kind)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise UsageError(
                f"tp {tp} does not divide {kind}'s {heads} {field.replace('_', ' ')}, which the"
                f" column-wise attention projections split; use a tp that divides {heads}"
            )
    return on_base_model(model, styles)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Split the planned layers of `model` over the 1-D `tp_mesh`, in place (their parameters become DTensors).

    Every tensor is taken from the tp group's first rank: the split ones by
    torch (``src_data_rank=0``), the rest broadcast here, so the group holds
    one model even if each rank initialised its own (nothing later would
    reconcile them: their gradients are equal, not averaged).
    """
    if any(isinstance(style, ExpertsSplit) for style in plan.values()):
        ExpertsSplit.check(tp_mesh, type(model).__name__)
    parallelize_module(model, tp_mesh, plan)
    group = tp_mesh.get_group()
    first = dist.get_global_rank(group, 0)
    for tensor in (*model.parameters(), *model.buffers()):
        if not isinstance(tensor, DTensor) and not tensor.is_meta:  # meta ones get equal values from the skeleton
            dist.broadcast(tensor.data, first, group=group)
    return model


def _copies(tensor: torch.Tensor, world: int) -> int:
    """How many of the `world` ranks hold the values this rank holds of `tensor` (a plain one: all)."""
    if not isinstance(tensor, DTensor):
        return world
    mesh = tensor.device_mesh
    # Every placement but Replicate splits the values: Shard, and FSDP2's _StridedShard over
    # a tp-split parameter, which is no Shard (is_shard() is False). Gradients are not Partial.
    return world // math.prod(mesh.size(i) for i, p in enumerate(tensor.placements) if not p.is_replicate())


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, device: torch.device) -> torch.Tensor:
    """torch's clip_grad_norm_ for gradients that mix plain tensors and DTensors of several meshes.

    Under tp the planned layers' gradients are DTensors on the "tp" mesh (2-D
    with FSDP2's dimension), the rest plain tensors or DTensors of FSDP2's
    mesh alone, and torch's foreach norm refuses to combine them. Each rank
    adds the squares of the values it holds, each divided by how many ranks
    hold the same values; summed over all ranks, that is the whole model's.
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    world = dist.get_world_size()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g, mine in zip(grads, local, strict=True):
        total += mine.float().pow(2).sum() / _copies(g, world)
    dist.all_reduce(total)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's formula, so tp clips as serial does
    for mine in local:
        mine.mul_(coef.to(mine.dtype))
    return norm
