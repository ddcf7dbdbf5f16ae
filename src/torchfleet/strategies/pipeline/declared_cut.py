"""Cutting a model that declares its own pipeline plan, as transformers' models do.

Llama and most decoder families in transformers carry ``base_model_pp_plan``
in their config: the base model's children in forward order with what flows
between them, e.g. ``embed_tokens: (input_ids -> inputs_embeds)``, ``layers:
(hidden_states, attention_mask -> hidden_states)``, ``norm``; the task model
adds its head (``LlamaForCausalLM._pp_plan``: ``lm_head -> logits``). Such
models need no tracing (torch.export fails on Llama's rotary embedding in
torch's pipeline tracer). As torchtitan builds stages, each stage keeps its
own modules and drops the others, and the model's own forward runs:

- the entries before the layers (the embeddings) stay on the first stage;
  a later stage drops those with parameters and hands its received activation
  to the forward through a keyword the forward takes in their place
  (``inputs_embeds``), so the forward skips them;
- the layers are cut between blocks; a stage keeps its blocks under their
  original indices, so parameter names (and state-dict keys) stay the model's;
- the entries after the layers and the head stay on the last stage; earlier
  stages replace them with ``nn.Identity`` to hold none of their memory.

What crosses between stages is exactly what one block hands the next, whatever
the model's forward does around its layers: a later stage's first block takes
the received activation as its input (a forward pre-hook puts it there, after
whatever the forward did to ``inputs_embeds``, such as Gemma's scaling by the
square root of the width), and an earlier stage sends its last block's output
(a forward hook takes it), not the forward's result. So the last stage runs the
model's whole output path as serial does (Gemma 2's soft-capping of the logits,
Cohere's ``logit_scale``), and no earlier stage's activation passes through it.

Every other input (``attention_mask``, ``position_ids``) reaches every stage,
since each stage's layers read it; ``labels`` only the last, whose head
computes the loss from them. A training forward asks for no cache.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchfleet.errors import UsageError
from torchfleet.strategies.blocks import base_model, library_model, on_base_model, under
from torchfleet.strategies.pipeline.cutting import Cut, example_rows, flat_output, has_scalar, stage_starts, tied_groups

# The inputs a transformers model computes its loss from, in its head: only the last stage
# has the head, and an earlier stage's forward would compute a loss on its hidden states.
LOSS_INPUTS = frozenset({"labels"})


def declared_plan(model: nn.Module) -> dict[str, tuple] | None:
    """The model's pipeline plan as {qualified module name: (inputs, outputs)}, in forward order; None without one."""
    inner = library_model(model)  # under peft's wrapping, the model it adapts
    config = getattr(inner, "config", None)
    base_plan = getattr(config, "base_model_pp_plan", None)
    if not base_plan:
        return None
    plan = on_base_model(model, base_plan)
    if getattr(inner, "base_model", inner) is not inner:  # a task model: its head, named in `model`
        plan.update(under(model, inner, getattr(type(inner), "_pp_plan", None) or {}))
    return plan


def _shape(model: nn.Module, plan: dict[str, tuple]) -> tuple[str, list[str], list[str], str]:
    """(the layers' name, the modules before them, after them, the keyword that takes an activation)."""
    kind = type(model).__name__
    names = list(plan)
    lists = [n for n in names if isinstance(model.get_submodule(n), nn.ModuleList)]
    if len(lists) != 1:
        raise UsageError(
            f"{kind}'s pipeline plan ({', '.join(names)}) names {len(lists)} lists of layers where"
            " torchfleet cuts between the layers of one; use fsdp or ddp for this model"
        )
    layers = lists[0]
    before, after = names[: names.index(layers)], names[names.index(layers) + 1 :]
    takes = inspect.signature(base_model(model).forward).parameters
    # The keyword that lets the forward skip the embeddings: the last activation before the layers that the
    # forward takes (Llama's inputs_embeds; GPT-NeoX's plan names hidden_states after its dropout, which its
    # forward does not take, and inputs_embeds before it).
    given = [out for name in before for out in plan[name][1]]
    embeds = next((out for out in reversed(given) if out in takes), None)
    if embeds is None:
        raise UsageError(
            f"{kind}'s pipeline plan gives its layers {given[-1] if given else 'nothing'}, which its forward does"
            " not take by keyword, so a later stage could not hand it its activation; use fsdp or ddp for this model"
        )
    return layers, before, after, embeds


def _holds(
    stage: int, stages: int, bounds: list[tuple[int, int]], layers: str, before: list[str], after: list[str], name: str
) -> bool:
    """Whether `stage` keeps the parameter or module `name`."""
    if name.startswith(layers + "."):
        index = int(name[len(layers) + 1 :].split(".", 1)[0])
        start, end = bounds[stage]
        return start <= index < end
    if any(name == m or name.startswith(m + ".") for m in before):
        return stage == 0
    if any(name == m or name.startswith(m + ".") for m in after):
        return stage == stages - 1
    return True  # modules outside the plan (rotary tables): every stage computes them


def cut_by_plan(
    model: nn.Module,
    plan: dict[str, tuple],
    stages: int,
    stage: int,
    split_points: Sequence[str] | None,
    example_args: tuple,
    example_kwargs: dict,
) -> Cut:
    """Stage `stage` of `stages` of a model with a declared plan: the model itself, its other stages' modules dropped."""
    kind = type(model).__name__
    layers, before, after, embeds = _shape(model, plan)
    blocks = model.get_submodule(layers)
    assert isinstance(blocks, nn.ModuleList)  # _shape took the plan's one ModuleList
    starts = stage_starts(model, stages, split_points)
    names = [f"{layers}.{i}" for i in range(len(blocks))]
    for start in starts:
        if start not in names:
            raise UsageError(
                f"split point {start!r} is not one of {kind}'s layers ({names[0]}..{names[-1]}),"
                " between which a model with a pipeline plan is cut; name one of them"
            )
    cuts = [0, *(names.index(s) for s in starts), len(names)]
    bounds = list(zip(cuts, cuts[1:], strict=False))
    if any(a >= b for a, b in bounds):
        raise UsageError(
            f"the split points {', '.join(starts)} leave a stage of {kind} without layers; name layers in forward order"
        )
    config = getattr(library_model(model), "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # no key/value cache in a training forward (see cutting.trace)
    leaves, out_spec = flat_output(model, example_args, example_kwargs)  # the whole model's, before the cut
    groups = tied_groups(model)
    holders = [
        [s for s in range(stages) if any(_holds(s, stages, bounds, layers, before, after, n) for n in g)]
        for g in groups
    ]
    first, last = stage == 0, stage == stages - 1
    start, end = bounds[stage]
    kept = nn.ModuleList()
    for index in range(start, end):  # under their own indices: names stay the model's
        kept.add_module(str(index), blocks[index])
    _replace(model, layers, kept)
    for name in before if not first else ():
        if any(True for _ in model.get_submodule(name).parameters()):
            _replace(model, name, None)  # the forward skips it: the activation comes by keyword
    for name in after if not last else ():
        _replace(model, name, nn.Identity())
    relay = _Relay(blocks[start] if not first else None, blocks[end - 1] if not last else None)
    slots, at = [], 0
    for leaf in leaves:  # the last stage returns the tensors among the output's leaves, in order
        slots.append(("out", at) if isinstance(leaf, torch.Tensor) else ("const", leaf))
        at += isinstance(leaf, torch.Tensor)
    # transformers' models take use_cache; peft's wrapping hands its keywords on to the model it adapts
    caches = "use_cache" in inspect.signature(type(library_model(model)).forward).parameters
    model.forward = functools.partial(_stage_forward, model.forward, relay, embeds, caches)
    signature = tuple(inspect.signature(type(model).forward).parameters)[1:]
    return Cut(
        model,
        starts,
        example_rows(example_args, example_kwargs),
        out_spec,
        slots,
        inputs=None,
        input_names=signature,
        first_only=frozenset(plan[before[0]][0]),
        last_only=LOSS_INPUTS,
        tied=[g for g, h in zip(groups, holders, strict=True) if len(h) > 1],
        holders=[h for h in holders if len(h) > 1],
        returns_scalar=has_scalar(leaves),
    )


def _replace(model: nn.Module, name: str, module: nn.Module | None) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, module)


class _Relay:
    """The activation between stages, at the blocks: the received one put in as the first block's input,
    this stage's last block's output taken as what it sends (see the module doc)."""

    def __init__(self, first_block: nn.Module | None, last_block: nn.Module | None):
        self.first, self.last = first_block is None, last_block is None
        self.incoming: torch.Tensor | None = None
        self.outgoing: torch.Tensor | None = None
        if first_block is not None:
            self.input_name = next(iter(inspect.signature(first_block.forward).parameters), "hidden_states")
            # prepend: before FSDP2's own pre-forward hook, which casts the block's inputs and registers its backward
            first_block.register_forward_pre_hook(self._put_in, prepend=True, with_kwargs=True)
        if last_block is not None:
            last_block.register_forward_hook(self._take_out)

    def _put_in(self, _module, args, kwargs):
        incoming, self.incoming = self.incoming, None  # once: a block is called once per forward
        if incoming is None:
            return None
        if args:
            return (incoming, *args[1:]), kwargs
        return args, {**kwargs, self.input_name: incoming}

    def _take_out(self, _module, _args, output):
        self.outgoing = output[0] if isinstance(output, (tuple, list)) else output


def _stage_forward(forward, relay: _Relay, embeds: str, caches: bool, *args, **kwargs):
    """The model's forward on one stage: a later stage's activation arrives as `embeds` and enters the first block
    as it came; an earlier stage returns its last block's output."""
    if not relay.first:
        (hidden, *args) = args
        kwargs[embeds] = hidden  # the forward needs an activation of the right shape in place of the embeddings
        relay.incoming = hidden
    out = forward(*args, use_cache=False, **kwargs) if caches else forward(*args, **kwargs)
    if relay.last:
        return tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    sent, relay.outgoing = relay.outgoing, None
    assert sent is not None, "the stage's last block did not run"
    return sent.contiguous()
