"""Cutting a model that is not an ``nn.Sequential`` into pipeline stages.

A Sequential's children are cut where they stand (strategies/parallelize.py). Any other
model (a transformer from a library, a ResNet) is cut by
`torch.distributed.pipelining`'s tracer: torch.export captures the forward
on one example micro-batch, and the graph is split where a named module
begins (``split_points``, e.g. ``transformer.h.2``). Without split points the
cut falls between the model's repeated blocks (strategies/blocks.py),
balanced by the blocks' parameter counts.

What the tracer does not do, done here:

- **Tied parameters** (GPT-2's input embedding is its output head): each
  stage that uses one gets its own copy. `tied_groups` finds them before the
  cut; the Pipeline strategy sums their gradients across the stages that hold
  them before each step, so every copy takes the same update and stays equal
  to the others (what serial computes for the one parameter).
- **The output's structure**: the last stage returns the forward's outputs
  flattened (a Hugging Face ``ModelOutput`` becomes a tuple, a ``None`` loss
  a constant of the graph); `Cut.unflatten` gives the loss function what the
  model returns in serial.
- **The model's inputs a later stage reads** (nanoGPT's ``targets``, read
  by its loss in the last stage): the tracer gives that stage the input
  itself; `Cut.stage_inputs` hands it over by keyword.
- **Activations that skip stages** (GPT-2's attention mask, made before
  the first block and read by every block): the tracer hands one from the
  stage computing it straight to each stage reading it, and torch's
  schedules give a stage only what the stage before it returns;
  `carry_skips` (skips.py) passes it through every stage in between.
- **Fixed shapes**: the traced stages are specialised to the example
  micro-batch's shape, so every micro-batch must have it (`Cut.batch`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchfleet.errors import UsageError
from torchfleet.strategies.blocks import describe, find_blocks, on_meta, parameter_names
from torchfleet.strategies.partition import partition
from torchfleet.strategies.pipeline.skips import carry_skips
from torchfleet.versions import release


@dataclass
class Cut:
    """This rank's stage of a cut model, and what the strategy needs to run it."""

    module: nn.Module  # the stage, holding the original parameter names
    starts: list[str]  # the module each stage after the first begins at
    batch: int  # the example micro-batch size (traced stages are specialised to it)
    out_spec: pytree.TreeSpec  # the structure of the model's output
    # Each leaf of the model's output: ("out", i), the last stage's i-th output (None: the stage
    # returns one value), or ("const", value), a leaf the forward returns as it is (a None loss).
    slots: list[tuple[str, Any]]
    # The model's inputs this stage takes, by keyword: {stage parameter: input name}; None
    # takes every input but `first_only` (a stage built from a plan calls the model's forward).
    inputs: dict[str, str] | None
    input_names: tuple[str, ...]  # the forward's parameters: a lone tensor input is the first
    first_only: frozenset[str] = frozenset()  # inputs only the first stage reads (token ids)
    last_only: frozenset[str] = frozenset()  # inputs only the last stage reads (a head's labels)
    tied: list[list[str]] = field(default_factory=list)  # alias names of each tied parameter
    holders: list[list[int]] = field(default_factory=list)  # the stages holding each tied parameter
    returns_scalar: bool = False  # the model returns a 0-dim tensor (its own loss): see stages.predict_in_chunks

    def stage_inputs(self, batch, first: bool, last: bool) -> dict:
        """The keyword arguments this stage takes from one (micro-)batch of the model's inputs."""
        named = dict(batch) if isinstance(batch, Mapping) else {self.input_names[0]: batch}
        if self.inputs is None:
            return {
                k: v
                for k, v in named.items()
                if (first or k not in self.first_only) and (last or k not in self.last_only)
            }
        return {param: named[name] for param, name in self.inputs.items() if name in named}

    def unflatten(self, output):
        """The last stage's output in the structure the model's forward returns in serial."""
        outputs = output if isinstance(output, tuple) else (output,)
        leaves = [value if kind == "const" else outputs[value or 0] for kind, value in self.slots]
        return pytree.tree_unflatten(leaves, self.out_spec)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of each parameter the model holds under more than one name."""
    return [group for group in parameter_names(model).values() if len(group) > 1]


def stage_starts(model: nn.Module, stages: int, split_points: Sequence[str] | None) -> list[str]:
    """Where each stage after the first begins: the user's split points, or between blocks."""
    kind = type(model).__name__
    modules = dict(model.named_modules())
    if split_points:
        if len(split_points) != stages - 1:
            raise UsageError(
                f"--split-points names {len(split_points)} points for {stages} stages;"
                f" give {stages - 1} (each stage after the first begins at one)"
            )
        for point in split_points:
            if point not in modules or not point:
                blocks = find_blocks(model)
                hint = f" such as {blocks[len(blocks) // 2][0]}" if blocks else ""
                raise UsageError(
                    f"split point {point!r} is not a module of this {kind}; name modules by their qualified names{hint}"
                )
        return list(split_points)
    blocks = find_blocks(model)
    if len(blocks) < stages:
        raise UsageError(
            f"cannot cut this {kind} into {stages} stages automatically: it has {len(blocks)} repeated"
            f" blocks ({describe(blocks)}); pass split_points (--split-points) naming the module"
            f" each stage after the first begins at"
        )
    sizes = partition([sum(p.numel() for p in b.parameters()) for _, b in blocks], stages)
    starts, at = [], 0
    for size in sizes[:-1]:
        at += size
        starts.append(blocks[at][0])
    return starts


def _retie(stage: nn.Module, groups: list[list[str]]) -> None:
    """Within one stage, make every name of a tied parameter one Parameter again.

    The tracer gives a stage one copy per name it keeps, and only one of
    them is used; the others would train nothing and save stale values.
    """
    for group in groups:
        present = [n for n in group if _has_parameter(stage, n)]
        if len(present) > 1:
            keep = stage.get_parameter(present[0])
            for name in present[1:]:
                owner, _, leaf = name.rpartition(".")
                setattr(stage.get_submodule(owner) if owner else stage, leaf, keep)


def _has_parameter(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
    except AttributeError:
        return False
    return True


def trace(
    model: nn.Module,
    stages: int,
    stage: int,
    split_points: Sequence[str] | None,
    example_args: tuple,
    example_kwargs: dict,
) -> Cut:
    """Trace `model` on one example micro-batch and keep stage `stage` of `stages`."""
    return trace_stages(model, stages, [stage], split_points, example_args, example_kwargs)[0]


def trace_stages(
    model: nn.Module,
    stages: int,
    local: Sequence[int],
    split_points: Sequence[str] | None,
    example_args: tuple,
    example_kwargs: dict,
) -> list[Cut]:
    """Trace `model` once and keep each stage of `local` (a process holding several stages)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    starts = stage_starts(model, stages, split_points)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        # A Hugging Face model returns its key/value cache by default, an object
        # torch.export cannot carry between stages; training never reads it.
        config.use_cache = False
    groups = tied_groups(model)
    leaves, out_spec = flat_output(model, example_args, example_kwargs)
    try:
        pipe = pipeline(
            model,
            mb_args=example_args,
            mb_kwargs=example_kwargs or None,
            split_spec={s: SplitPoint.BEGINNING for s in starts},
        )
    except Exception as error:  # torch.export's reasons are many; the first line says which
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"could not trace this {type(model).__name__} to cut it into pipeline stages"
            f" ({reason}); pass an nn.Sequential, or use fsdp or ddp for this model"
        ) from None
    if pipe.num_stages != stages:
        raise UsageError(
            f"the split points {', '.join(starts)} cut this {type(model).__name__} into"
            f" {pipe.num_stages} stages, not {stages}; name modules the forward calls in order"
        )
    modules = [pipe.get_stage_module(s) for s in range(stages)]
    run_generated_code(pipe, modules, example_args, example_kwargs)
    kind = type(model).__name__
    roots = [n.name for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]
    inputs = [_traced_inputs(pipe.split_gm, s, kind, starts) for s in range(stages)]
    slots = _traced_slots(pipe.split_gm, stages, out_spec, kind, starts)  # before carry_skips rewrites the stages
    carry_skips(pipe.split_gm, _stage_calls(pipe.split_gm))
    if release() < (2, 14):
        named = dict(zip(roots, example_args, strict=False)) | example_kwargs
        _refuse_integer_activations(modules, [{p: named[n] for p, n in i.items()} for i in inputs])
    holders = [[s for s, m in enumerate(modules) if any(_has_parameter(m, n) for n in g)] for g in groups]
    cuts = []
    for stage in local:
        cut = Cut(
            modules[stage],
            starts,
            example_rows(example_args, example_kwargs),
            out_spec,
            slots,
            inputs[stage],
            tuple(roots),
            tied=[g for g, h in zip(groups, holders, strict=True) if len(h) > 1],
            holders=[h for h in holders if len(h) > 1],
            returns_scalar=has_scalar(leaves),
        )
        _retie(cut.module, groups)
        keep_frozen(cut.module, model)
        cuts.append(cut)
    return cuts


def run_generated_code(pipe, modules: list[nn.Module], args: tuple, kwargs: dict) -> None:
    """Have the traced stages' submodules run the Python code FX generates for their graphs.

    torch.export's unflattened submodules (InterpreterModule) otherwise run every call through
    torch.fx.Interpreter, node by node (a flag each reads when made; torch.export.unflatten's
    _disable_interpreter turns it off for dynamo). The generated code runs the same ops in the same
    order, so the results are the same bits, without the Python per node: on the built-in gpt tiny
    in 2 stages on 2 Gloo processes, the step went from 1.39x a hand-cut pipeline's time to 1.10x
    (benchmarks/parity.py --only gpt). Not every graph's code runs (Hugging Face's BERT fails in
    it, torch 2.14), so one forward of the whole split model on the example tries it first, and
    any failure leaves every stage on the interpreter, as before.
    """
    subs: list[Any] = [
        sub
        for m in modules
        for sub in m.modules()
        if getattr(sub, "graph_module", None) is not None and getattr(sub, "_run_with_interpreter", False)
    ]
    for sub in subs:
        sub._run_with_interpreter = False  # torch's own switch (see _disable_interpreter)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            pipe(*args, **kwargs)
    except Exception:  # whatever the generated code trips on, the interpreter ran it when tracing
        for sub in subs:
            sub._run_with_interpreter = True


def flat_output(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
    """The leaves and structure of what `model` returns for these inputs (one forward, no gradients).

    A model on the meta device runs on fake tensors of its shapes on the inputs' device instead: meta kernels
    refuse what a forward computes from its data (a mixture of experts' routing), fake CPU ones do not. Its
    floating-point tensors are faked in bf16: the grouped matrix products of transformers' experts have fake
    kernels for bf16 and fp16 only (torch 2.14), and the output's structure does not depend on the dtype."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        if not on_meta(model):
            return pytree.tree_flatten(model(*args, **kwargs))
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.func import functional_call

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            device = next((t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
            tensors = {
                name: torch.empty(t.shape, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype, device=device)
                for name, t in (*model.named_parameters(), *model.named_buffers())
            }
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            return pytree.tree_flatten(functional_call(model, tensors, fake[0], fake[1]))


def has_scalar(leaves: list) -> bool:
    """Whether a model's output leaves hold a 0-dim tensor (a loss it computes itself)."""
    return any(isinstance(leaf, torch.Tensor) and leaf.dim() == 0 for leaf in leaves)


def keep_frozen(stage: nn.Module, model: nn.Module) -> None:
    """A stage's parameters train where the model's do: a frozen parameter stays frozen."""
    trains = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
    for name, p in stage.named_parameters(remove_duplicate=False):
        if name in trains:
            p.requires_grad_(trains[name])


def _stage_calls(split_gm) -> list:
    return [n for n in split_gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]


def _traced_slots(split_gm, stages: int, out_spec, kind: str, starts: list[str]) -> list[tuple[str, Any]]:
    """Where each leaf of the model's output comes from in the traced graph (see Cut.slots)."""
    last = _stage_calls(split_gm)[stages - 1]
    (returned,) = [n.args[0] for n in split_gm.graph.nodes if n.op == "output"]
    leaves = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    slots: list[tuple[str, Any]] = []
    for leaf in leaves:
        if not isinstance(leaf, torch.fx.Node):
            slots.append(("const", leaf))
        elif leaf is last:
            slots.append(("out", None))
        elif leaf.op == "call_function" and leaf.args and leaf.args[0] is last:
            slots.append(("out", leaf.args[1]))
        else:
            raise UsageError(
                f"this {kind} returns a value computed before its last pipeline stage ({leaf.name}),"
                f" which the cut at {', '.join(starts)} cannot hand to the loss; cut it later"
                " (--split-points) or use fsdp or ddp for this model"
            )
    if len(slots) != out_spec.num_leaves:
        raise UsageError(
            f"the traced {kind} returns {len(slots)} values where its forward returns"
            f" {out_spec.num_leaves}; use fsdp or ddp for this model"
        )
    return slots


def _traced_inputs(split_gm, stage: int, kind: str, starts: list[str]) -> dict[str, str]:
    """{stage parameter: model input} for the model's inputs the traced stage reads itself.

    The tracer hands a later stage an input of the model (nanoGPT's `targets`, read by
    the loss in the last stage) straight from the caller, after the activations it
    receives; it is passed to that stage by keyword.
    """
    call = _stage_calls(split_gm)[stage]
    module = split_gm.get_submodule(call.target)
    params = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    taken: dict[str, str] = {}
    for param, arg in zip(params, call.args, strict=True):
        if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
            taken[param] = arg.name
        elif taken and stage:  # an activation after an input: torch passes activations first
            raise UsageError(
                f"the cut at {', '.join(starts)} gives stage {stage} of this {kind} an input"
                f" of the model ({', '.join(taken.values())}) before the activations it receives,"
                " which torch's schedules cannot pass; cut elsewhere (--split-points)"
            )
    return taken


def _refuse_integer_activations(modules, inputs: list[dict]) -> None:
    """Before 2.14 torch sends a gradient back for every tensor a stage receives, and an
    integer one (a mask, positions) has none: training fails inside the schedule with an
    error about gradients. Found here, on every rank at once, by running the cut once."""
    received: set[str] = set()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        out = modules[0](**inputs[0])
        for module, taken in zip(modules[1:], inputs[1:], strict=True):  # each takes the last one's outputs
            sent = out if isinstance(out, tuple) else (out,)
            received.update(str(t.dtype) for t in sent if isinstance(t, torch.Tensor) and not t.is_floating_point())
            out = module(*sent, **taken)
    if received:
        raise UsageError(
            f"this cut sends {', '.join(sorted(received))} tensors between pipeline stages,"
            f" which torch {torch.__version__.split('+')[0]} cannot train through (2.14 can);"
            " upgrade torch, or use fsdp for this model"
        )


def example_rows(args: tuple, kwargs: dict) -> int:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return leaf.shape[0]
    raise UsageError("the example inputs hold no tensor with a batch dimension to trace the pipeline with")
