"""A pipeline's whole-model state: every stage's part gathered under the model's own keys, and back.

Each process holds one stage, so the full state dict (what ``save_model`` and
an unsharded checkpoint write) is gathered to rank 0 from the first replica's
stages. Its keys are exactly the model's own ``state_dict()`` keys, in their
order, whatever the cut did to them: a tracer keeps one name of a tied
parameter (BERT's ``cls.predictions.bias`` is its decoder's bias) and adds
non-persistent buffers and traced constants (``lifted_tensor_0``) as entries
of its own; the file loads strictly into a fresh copy of the model. The
optimizer state is keyed by parameter name, so it loads into any other cut.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from torchfleet.strategies.pipeline.transfer import full, like, to_cpu


@dataclass(frozen=True)
class ModelKeys:
    """The whole model's state-dict keys, and the names of each parameter it holds under several."""

    keys: list[str]
    tied: list[list[str]]

    @functools.cached_property
    def names(self) -> frozenset[str]:
        return frozenset(self.keys)

    def find(self, key: str, state: dict) -> str | None:
        """`key`, or another name of the same tied parameter, as `state` holds it; None if neither."""
        names = next((group for group in self.tied if key in group), [key])
        return next((n for n in (key, *names) if n in state), None)


def _named_optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict:
    """A stage's optimizer state keyed by parameter name, not position."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.state_dict()
    return {
        "state": {order[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def gather_stages(
    model: nn.Module, optimizer: Optimizer, stage: int, dp_rank: int, keys: ModelKeys
) -> tuple[dict, dict]:
    """(model, optimizer) state of the whole model on rank 0, ({}, {}) elsewhere. Every rank calls it."""
    # A sharded stage's tensors are gathered whole first, by every rank of its shard group.
    mine = to_cpu(full((stage, dp_rank, model.state_dict(), _named_optimizer_state(model, optimizer))))
    every: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    if every is None:
        return {}, {}
    stages = sorted((s for s in every if s[1] == 0), key=lambda s: s[0])
    merged, state, groups = {}, {}, []
    for _, _, stage_model, stage_optim in stages:
        merged.update(stage_model)
        state.update(stage_optim["state"])
        for i, g in enumerate(stage_optim["param_groups"]):
            if i == len(groups):
                groups.append({**g, "params": []})
            groups[i]["params"] += g["params"]
    model_state = {}
    for key in keys.keys:
        held = keys.find(key, merged)
        if held is not None:
            model_state[key] = merged[held]
    return model_state, {"state": state, "param_groups": groups}


def load_stage(
    model: nn.Module, optimizer: Optimizer, model_state: dict, optimizer_state: dict, keys: ModelKeys
) -> None:
    """This stage's entries of a whole-model state (and its shards of them), into `model` and `optimizer`."""

    def saved(key: str, value):  # a constant the cut added (not in the file) keeps its own value
        held = keys.find(key, model_state)
        return like(model_state[held], value) if held is not None else value

    model.load_state_dict({k: saved(k, v) for k, v in model.state_dict().items()})
    names = {id(p): n for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    saved_groups = {n: g for g in optimizer_state["param_groups"] for n in g["params"]}
    order, groups = [], []
    for g in optimizer.param_groups:
        group_names = [names[id(p)] for p in g["params"]]
        source = saved_groups[group_names[0]] if group_names else g
        groups.append(
            {
                **{k: v for k, v in source.items() if k != "params"},
                "params": list(range(len(order), len(order) + len(group_names))),
            }
        )
        order += group_names
    state = {
        i: {k: like(v, params[n]) for k, v in optimizer_state["state"][n].items()}
        for i, n in enumerate(order)
        if n in optimizer_state["state"]
    }
    optimizer.load_state_dict({"state": state, "param_groups": groups})
