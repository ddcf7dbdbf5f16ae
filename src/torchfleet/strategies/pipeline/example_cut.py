"""This process's stages of a model that is not a Sequential, cut at setup on one micro-batch of the example.

The model's own pipeline plan cuts it where it declares one (declared_cut.py; the
example then sizes the stages), tracing the micro-batch cuts any other (cutting.py).
The cut stages are then checkpointed and compiled as `fleet.setup` asks: a traced
stage is one graph, so as a whole; a plan's stage keeps its blocks, so block by block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torchfleet.errors import UsageError
from torchfleet.strategies.base import SetupArgs, batch_size, split_batch
from torchfleet.strategies.block_transforms import checkpoint_activations, compile_model
from torchfleet.strategies.blocks import on_meta
from torchfleet.strategies.pipeline import cutting
from torchfleet.strategies.pipeline.declared_cut import declared_plan
from torchfleet.strategies.pipeline.local_stages import cut_local


def cut_on_example(
    model: nn.Module,
    setup: SetupArgs,
    microbatches: int,
    stages: int,
    local: Sequence[int],
    split_points: Sequence[str] | None,
    device: torch.device,
) -> tuple[list[cutting.Cut], list[str]]:
    """Stages `local` of `stages`, cut on one micro-batch of `setup.example` (which the caller checked is
    there), and the notes saying how they were cut, checkpointed and compiled."""
    example, grad_accum = setup.example, setup.grad_accum
    assert example is not None
    per_step = batch_size(example) // grad_accum
    if per_step % microbatches or per_step < microbatches:
        raise UsageError(
            f"each pipeline's batch of {per_step} does not split into {microbatches}"
            f" micro-batches; use a batch size per replica that is a multiple of it"
        )
    micro = split_batch(example, batch_size(example) // (per_step // microbatches))[0]
    args, kwargs = ((), dict(micro)) if isinstance(micro, dict) else ((micro,), {})
    plan = declared_plan(model)
    if on_meta(model):
        if plan is None:
            raise UsageError(
                f"{type(model).__name__} is on the meta device, and a pipeline cuts a model without a pipeline plan by"
                " tracing it, which needs its weights; build it with real tensors, or use fsdp or tp for it"
            )
    else:
        model.to(device)  # the example is there already
    cuts = cut_local(model, stages, local, split_points=split_points, args=args, kwargs=kwargs, plan=plan)
    notes = []
    if plan is not None:
        notes.append(
            f"pipeline stages from {type(model).__name__}'s own pipeline plan"
            f" ({', '.join(plan)}), cut at {', '.join(cuts[0].starts)}"
        )
    checkpointing, compile_mode = setup.activation_checkpointing, setup.compile
    # A traced stage is one graph: checkpointed and compiled as a whole; a plan's keeps its blocks.
    how = "each pipeline stage as a whole (traced)" if plan is None else "each block of each pipeline stage"
    for cut in cuts:
        if checkpointing:
            checkpoint_activations(cut.module)
        if compile_mode:
            compile_model(cut.module, "model" if plan is None else "blocks")
    if checkpointing:
        notes.append(f"activation checkpointing: {how}")
    if compile_mode:
        notes.append(f"torch.compile: {how}")
    return cuts, notes
