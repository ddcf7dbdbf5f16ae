"""Several pipeline stages in one process: cut them, share what they share, and hold them as one model.

Interleaved, looped and zero-bubble schedules give each process K stages of
a model cut into pp x K (strategies/pipeline/schedules.py says which). What the rest
of torchfleet sees of a process (the optimizer, `state_dicts`, sharded
checkpoints, clipping, the memory report) is one module holding this
process's parameters under the model's own names: `LocalStages` grafts the
stages' parameters and buffers onto one tree of plain modules, the same
tensors the stages compute with, so a checkpoint written from it loads into
any other cut, strategy or number of processes, as one stage's does.

A parameter two local stages both hold (a tied embedding and head on the
first and last stage of a V, or a module a plan gives every stage) becomes
one Parameter again before the graft: autograd adds both stages' gradients
into it, and only the copies on other processes need summing (gradients.py).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from torchfleet.strategies.parallelize import split_balanced
from torchfleet.strategies.pipeline import cutting
from torchfleet.strategies.pipeline.declared_cut import cut_by_plan
from torchfleet.strategies.pipeline.transfer import recv_tensors, send_tensors


class LocalStages(nn.Module):
    """This process's stages under the model's own parameter names; the schedule runs the stages."""

    def __init__(self, stages: Sequence[nn.Module], model_keys: frozenset[str]):
        super().__init__()
        self.stage_list = list(stages)  # a list, not children: their names would prefix the model's
        for stage in stages:
            _graft(self, stage, model_keys)

    def train(self, mode: bool = True):
        super().train(mode)
        for stage in self.stage_list:  # the tree holds no stage, so reach them here (dropout in predict)
            stage.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise NotImplementedError("a pipeline's schedule runs its stages")  # the strategy's hook says more


def _node(root: nn.Module, path: str) -> nn.Module:
    """The module at `path` under `root`, made (a plain nn.Module) where missing."""
    node = root
    for part in path.split(".") if path else ():
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    return node


def _graft(root: nn.Module, stage: nn.Module, model_keys: frozenset[str]) -> None:
    for path, module in stage.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None and _free(root, path, name, param, model_keys):
                _node(root, path).register_parameter(name, param)
        for name, buf in module._buffers.items():
            if buf is not None and _free(root, path, name, buf, model_keys):
                _node(root, path).register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)


def _free(root: nn.Module, path: str, name: str, tensor: torch.Tensor, model_keys: frozenset[str]) -> bool:
    """Whether `path.name` is still free in `root`; two different tensors of the model under one name are a bug."""
    key = f"{path}.{name}" if path else name
    try:
        held = root.get_submodule(path) if path else root
    except AttributeError:
        return True
    current = held._parameters.get(name, held._buffers.get(name))
    if current is None:
        return True
    # A traced constant (lifted_tensor_0) in two stages is no key of the model: each stage keeps its own.
    assert current is tensor or key not in model_keys, f"two stages hold different tensors as {key}"
    return False


def share_tensors(stages: Sequence[nn.Module], tied: Sequence[Sequence[str]], model_keys: frozenset[str]) -> None:
    """Make every parameter or buffer of the model that several local stages hold (by name, or tied) one tensor."""
    group = {name: names[0] for names in tied for name in names}  # each alias -> its group's first name
    seen: dict[str, torch.Tensor] = {}
    for stage in stages:
        for path, module in list(stage.named_modules(remove_duplicate=False)):
            tables: tuple[dict, dict] = (module._parameters, module._buffers)
            for table in tables:
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    key = f"{path}.{name}" if path else name
                    if key not in model_keys and key not in group:  # a traced constant: each stage its own
                        continue
                    key = group.get(key, key)
                    kept = seen.setdefault(key, tensor)
                    if kept is not tensor and kept.shape == tensor.shape:
                        table[name] = kept


def cut_local(
    model: nn.Module, total: int, local: Sequence[int], *, split_points, args: tuple, kwargs: dict, plan: dict | None
) -> list[cutting.Cut]:
    """Cuts of stages `local` of `total`: by the model's plan (a copy of the model per extra stage) or traced."""
    if plan is None:
        return cutting.trace_stages(model, total, local, split_points, args, kwargs)
    copies = [model_copy(model) for _ in local[1:]] + [model]  # cut_by_plan cuts the model in place
    return [cut_by_plan(m, plan, total, s, split_points, args, kwargs) for m, s in zip(copies, local, strict=True)]


def model_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model`. Fake tensors (plan's traces) are cloned in their own mode: deepcopy would give each a
    fake mode of its own, which torch refuses to mix with the inputs' ("Mixing fake modes")."""
    from torch._subclasses.fake_tensor import is_fake

    memo: dict[int, torch.Tensor] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if is_fake(tensor):
            clone = tensor.detach().clone()
            memo[id(tensor)] = nn.Parameter(clone, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else clone
    return copy.deepcopy(model, memo)


def sequential_stages(
    model: nn.Sequential, total: int, local: Sequence[int]
) -> tuple[list[nn.Module], list[tuple[int, int]]]:
    """Stages `local` of a Sequential cut into `total` by its children, and every stage's [start, end)."""
    bounds = split_balanced(model, total)
    children = list(model.named_children())
    return [nn.Sequential(OrderedDict(children[a:b])) for a, b in (bounds[s] for s in local)], bounds


def run_stages(
    stages: Sequence[tuple[int, nn.Module]],
    total: int,
    first_args: tuple,
    kwargs: dict,
    peer: Callable[[int], int],
    device: torch.device,
):
    """One forward through this process's stages outside a schedule (inference), in stage order.

    An activation goes to the next stage's process when that stage is not here, and
    comes from the previous one's; the last stage's output is returned (None elsewhere).
    """
    held = {s for s, _ in stages}
    out = None
    for index, module in stages:
        if index == 0:
            inputs = first_args
        elif index - 1 in held:
            inputs = out if isinstance(out, tuple) else (out,)
        else:
            inputs = recv_tensors(peer(index - 1), device)
        out = module(*inputs, **kwargs)
        if index == total - 1:
            return out
        if index + 1 not in held:
            send_tensors(out if isinstance(out, tuple) else (out,), peer(index + 1), device)
    return None
