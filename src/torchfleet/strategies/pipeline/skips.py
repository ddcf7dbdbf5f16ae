"""Activations that skip pipeline stages, carried through the stages in between.

torch's pipeline tracer lets a stage read a value any earlier stage computed:
GPT-2's attention mask is made once, before the first block, and every block
reads it, so cut into 4 stages the split graph hands it from stage 0 straight
to stages 1, 2 and 3. torch's schedules (and `PipelineStage`) give a stage
only the outputs of the stage just before it, so stage 2 would run without
the mask ("forward() missing 1 required positional argument"). With 2 stages
there is nothing in between and nothing to do.

`carry_skips` rewrites the traced stages in place: each stage between the one
computing such a value and the last one reading it takes the value as one
more input and returns it as one more output, after its own. A stage then
returns exactly what the next one takes, in the order it takes it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx


def _source(node: fx.Node, calls: list[fx.Node]) -> tuple[int, int | None] | None:
    """(stage, output index) of a value of the split graph: a stage's call (its one output, None)
    or an output taken from one; None for an input of the model, which each stage that reads it
    gets by keyword (Cut.stage_inputs)."""
    if node in calls:
        return calls.index(node), None
    if node.op == "call_function" and node.target is operator.getitem and node.args[0] in calls:
        index = node.args[1]
        assert isinstance(index, int)
        return calls.index(node.args[0]), index
    return None


def carry_skips(split_gm: fx.GraphModule, calls: list[fx.Node]) -> None:
    """Make every traced stage return what the next stage takes (`calls`: the stages' calls, in order).

    Only the stage modules, which the schedule runs, change: the split graph still calls
    them as the tracer made them, so it must not run after this.
    """
    stages = len(calls)
    source = {
        a: where
        for call in calls
        for a in call.args
        if isinstance(a, fx.Node) and (where := _source(a, calls)) is not None
    }
    # What each stage must receive from the one before: its own activations, then those a
    # later stage reads that an earlier stage computes (it passes them on).
    received: list[list[fx.Node]] = [[] for _ in range(stages + 1)]
    for s in range(stages - 1, 0, -1):
        own = [a for a in calls[s].args if a in source]
        received[s] = own + [v for v in received[s + 1] if v not in own and source[v][0] < s]
    for s in range(stages - 1):
        stage = split_gm.get_submodule(str(calls[s].target))
        assert isinstance(stage, fx.GraphModule)  # split_module makes every stage one
        _rewrite(stage, calls[s], s, received[s], received[s + 1], source)


def _rewrite(
    stage: fx.GraphModule, call: fx.Node, index: int, takes: list[fx.Node], gives: list[fx.Node], source: dict
) -> None:
    """Give stage `index` an input for each value of `takes` it lacks, and return `gives`, in order."""
    graph = stage.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    local = {arg: p for arg, p in zip(call.args, placeholders, strict=True) if isinstance(arg, fx.Node)}
    (output,) = [n for n in graph.nodes if n.op == "output"]
    returned = output.args[0]
    if all(v in local for v in takes) and [source[v] for v in gives] == (
        [(index, i) for i in range(len(returned))] if isinstance(returned, (tuple, list)) else [(index, None)]
    ):
        return  # it returns what the next stage takes already (every cut into 2 stages)
    # New inputs go right after the activations: the schedule passes what the stage before
    # returns by position, and the model's own inputs come by keyword.
    after = ([p for arg, p in local.items() if arg in source] or [None])[-1]
    for value in takes:
        if value not in local:
            with graph.inserting_before(placeholders[0]) if after is None else graph.inserting_after(after):
                after = local[value] = graph.placeholder(f"carried_{value.name}")
    outputs = []
    with graph.inserting_before(output):
        for value in gives:
            at, item = source[value]
            if at == index:
                outputs.append(returned[item] if item is not None else returned)
            else:
                # A copy, not the received tensor itself: the zero-bubble schedules free a
                # stage's outputs with detach_() after its backward, which must leave the
                # stage's inputs alone.
                outputs.append(graph.call_function(torch.clone, (local[value],)))
    output.args = (tuple(outputs) if len(outputs) > 1 else outputs[0],)
    graph.lint()
    stage.recompile()
