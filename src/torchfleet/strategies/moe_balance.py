"""The router's load-balancing loss of a transformers mixture-of-experts model, over the whole global batch.

With ``output_router_logits`` on, transformers' MoE causal LMs (Mixtral, Qwen2-MoE, OLMoE, DeepSeek
and most others: ``load_balancing_loss_func`` in each model's module) add Switch Transformer's
auxiliary loss ``E * sum_e f_e * P_e``, ``f_e`` the fraction of the top-k picks that went to expert
``e`` and ``P_e`` its mean router probability, both over every token of the batch and every MoE
layer, times ``router_aux_loss_coef`` when labels are given. A product of two means over the batch is
not the mean of the same products over its parts: each data-parallel rank computing it over its own
rows, averaged by DDP or FSDP, is not serial's loss. Measured on Mixtral's config (4 experts, top-2),
the mean of the ranks' losses is 5e-5 off serial's on 2 processes and 1.2e-3 on 4, and after 5 SGD
steps at coefficient 1 the weights are 8.6e-5 off serial's on 2.

``f`` is counted, not differentiated (top-k picks), so serial's gradient is ``E * sum_e f_e * dP_e``.
Here each rank sums the counts and the number of rows (an attention mask makes them differ between
ranks) over the data-parallel ranks, detached, and keeps its own probabilities, scaled to the global
rows: ``E * sum_e f_e * p_e * R / N``, ``p_e`` this rank's sum of probabilities, ``R`` the ranks, ``N``
the global rows. The average over the ranks, which is what the gradient reduction takes, is serial's
loss and its gradient serial's. The cost is one all-reduce of ``E + 1`` numbers per data-parallel
dimension per forward.

A forward hook on the model recomputes it so, replaces ``aux_loss`` with it, and moves ``loss`` (which
holds the coefficient times the local aux with labels) by the difference; transformers' code is left
as it is. Only a training forward with gradients is changed: an evaluation may run on some ranks only,
and it has no gradient to make right. With gradient accumulation each micro-step's loss is over its
own micro-batches, as serial's would be over its own.
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from torchfleet.strategies.blocks import library_model


class RouterLoss(NamedTuple):
    """What a transformers MoE model's load-balancing loss is computed with."""

    experts: int
    top_k: int
    coefficient: float


def router_loss(model: nn.Module) -> RouterLoss | None:
    """`model`'s load-balancing loss settings when its config turns the loss on; None otherwise.

    The causal LMs that call ``load_balancing_loss_func`` keep the experts, the top-k and the
    coefficient as attributes of the same names.
    """
    inner = library_model(model)
    if not getattr(getattr(inner, "config", None), "output_router_logits", False):
        return None
    experts = getattr(inner, "num_experts", None)
    top_k = getattr(inner, "num_experts_per_tok", None)
    coefficient = getattr(inner, "router_aux_loss_coef", None)
    if not (isinstance(experts, int) and isinstance(top_k, int) and isinstance(coefficient, (int, float))):
        return None
    return RouterLoss(experts, top_k, float(coefficient))


def routes_to_the_loss(model: nn.Module) -> bool:
    """True when `model`'s config asks its forward to return the router logits (its auxiliary loss needs them)."""
    return bool(getattr(getattr(library_model(model), "config", None), "output_router_logits", False))


def balance_loss(
    router_logits: tuple[torch.Tensor, ...], settings: RouterLoss, attention_mask: torch.Tensor | None, groups: list
) -> torch.Tensor:
    """This rank's share of the load-balancing loss of the batch all `groups` read together.

    transformers' load_balancing_loss_func with the counts and the rows summed over `groups`; with no
    group it is that function's value.
    """
    device = router_logits[0].device
    counts = torch.zeros(settings.experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(settings.experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in router_logits:
        routing = F.softmax(layer.to(device), dim=-1)  # in the logits' dtype, where transformers picks the top-k
        _, chosen = torch.topk(routing, settings.top_k, dim=-1)
        picks = (
            torch.ones(chosen.numel(), device=device) if weight is None else weight.repeat_interleave(settings.top_k)
        )
        counts = counts.scatter_add(0, chosen.reshape(-1), picks)
        routing = routing.float() if weight is None else routing.float() * weight.unsqueeze(-1)
        probabilities = probabilities + routing.sum(dim=0)
        rows = rows + (routing.shape[0] if weight is None else weight.sum())
    totals = torch.cat([counts, rows.reshape(1)]).detach()
    for group in groups:
        dist.all_reduce(totals, group=group)
    ranks = math.prod(dist.get_world_size(group) for group in groups)
    fractions, global_rows = totals[:-1] / totals[-1], totals[-1]
    return settings.experts * (fractions * probabilities).sum() * (ranks / global_rows)


def balance_over(model: nn.Module, groups: list) -> str | None:
    """Make `model`'s load-balancing loss the global batch's over the data-parallel `groups`; a note, or None.

    Nothing to do when the model has no such loss turned on, or no group has more than one rank.
    """
    groups = [g for g in groups if dist.get_world_size(g) > 1]
    settings = router_loss(model)
    inner = library_model(model)
    if not groups:
        return None
    if settings is None:
        if routes_to_the_loss(model):
            return (
                f"{type(inner).__name__} returns its router logits, but torchfleet does not know its"
                " auxiliary loss: each data-parallel rank computes it over its own rows"
            )
        return None
    signature = inspect.signature(inner.forward)

    def rebalance(module: nn.Module, args: tuple, kwargs: dict, output):
        logits = getattr(output, "router_logits", None)
        local = getattr(output, "aux_loss", None)
        if not (module.training and torch.is_grad_enabled()) or not isinstance(logits, tuple) or local is None:
            return None
        mask = signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
        balanced = balance_loss(logits, settings, mask, groups)
        if output.loss is not None:  # with labels transformers added the coefficient times the local loss
            output.loss = output.loss + settings.coefficient * (balanced - local).to(output.loss.device)
        output.aux_loss = balanced
        return output

    inner.register_forward_hook(rebalance, with_kwargs=True)
    ranks = math.prod(dist.get_world_size(g) for g in groups)
    return (
        f"{type(inner).__name__}'s router load-balancing loss counts the expert picks over all {ranks}"
        " data-parallel ranks, as serial counts them over the whole batch"
    )
