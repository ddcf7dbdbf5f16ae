"""Every stage's input and output shapes, worked out in one process, for a process group that cannot send them.

torch's PipelineStage learns its inputs' shapes at the first step from the
stage before it, over the process group. A fake group (the one `plan` traces a
pipeline rank's step on, plan/layout_trace.py) sends nothing, and torch then
refuses to run ("requires dynamic shape inference, which is not supported with
a fake process group") unless each stage is given its shapes when it is made.
This module gives them: a copy of the whole model, taken before the strategy
cuts it, is cut into every stage as the strategy cuts it, and one micro-batch
runs through the stages in turn. On fake tensors that costs no memory.

Only the fake group takes this path; real groups keep torch's own inference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchfleet.strategies.pipeline.declared_cut import declared_plan
from torchfleet.strategies.pipeline.local_stages import cut_local, sequential_stages
from torchfleet.strategies.pipeline.stages import TimedStage


def stage_shapes(
    whole: nn.Module, micro, stages: int, split_points: Sequence[str] | None, autocast: Callable
) -> list[tuple[tuple, tuple]]:
    """(inputs, outputs) of each of `stages` stages of `whole` for one micro-batch `micro`, as meta tensors:
    what a Sequential's first stage takes positionally (a cut stage takes the model's inputs by keyword), and
    what each stage returns (the next one's inputs)."""
    # The model's inputs as the model takes them: by name from a dict, else one positional tensor.
    whole_args, whole_kwargs = ((), dict(micro)) if isinstance(micro, Mapping) else ((micro,), {})
    if isinstance(whole, nn.Sequential) and not split_points:
        modules, cuts = sequential_stages(whole, stages, range(stages))[0], None
    else:
        plan = declared_plan(whole)
        cuts = cut_local(
            whole, stages, range(stages), split_points=split_points, args=whole_args, kwargs=whole_kwargs, plan=plan
        )
        modules = [cut.module for cut in cuts]
    shapes, out = [], ()
    with autocast():  # with gradients: what needs one tells torch which gradients each stage receives
        for index, module in enumerate(modules):
            first, last = index == 0, index == stages - 1
            if cuts is not None:
                args, kwargs = (() if first else out), cuts[index].stage_inputs(micro, first, last)
            elif first:
                args, kwargs = whole_args, whole_kwargs
            else:
                args, kwargs = out, {}
            result = module(*args, **kwargs)
            out = tuple(result) if isinstance(result, (tuple, list)) else (result,)
            shapes.append((_metas(args), _metas(out)))
    return shapes


def _metas(tensors: tuple) -> tuple:
    # Contiguous, as TimedStage sends every output (stages.py: _contiguous_outputs).
    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)

    return pytree.tree_map_only(torch.Tensor, meta, tensors)


def static_stages(stages: list[TimedStage], shapes: list[tuple[tuple, tuple]]) -> list[TimedStage]:
    """`stages` made again, each given its inputs' and outputs' shapes."""
    made = []
    for stage in stages:
        stage.contiguous_hook.remove()  # the new stage hooks the same module again
        inputs, outputs = shapes[stage.stage_index]
        made.append(
            TimedStage(
                stage.submod,
                stage.stage_index,
                stage.num_stages,
                stage.device,
                input_args=inputs,
                output_args=outputs,
                group=stage.group,
            )
        )
    return made
