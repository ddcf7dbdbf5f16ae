"""Tensor parallelism for `plan --hf-config --tp`: torchtitan's layout on a Hugging Face decoder.

Each block's attention and feed-forward products are split over the tp ranks
as the model's own config names them (`base_model_tp_plan`: "colwise" splits
a product's outputs, "rowwise" its inputs), with sequence parallelism between
them: the norms and the residual stream hold 1/tp of the sequence, gathered
before each split product and reduce-scattered after it. The embedding splits
the vocabulary by rows, the output layer by columns, and the loss is computed
on the split logits (loss_parallel), so no rank holds the whole vocabulary's
logits. This is the layout torchtitan's parallelize_llama gives its "TP".

Tracing it on fake tensors needs two torch internals kept out of the trace
(`traceable`): FSDP2 builds a device mesh per tensor-parallel parameter from
real index tensors, and DTensor works out output shapes by running each
operator on whole-shaped tensors, which would otherwise be counted as a rank's
work and memory.
"""

from __future__ import annotations

import contextlib

from torchfleet.errors import UsageError


def check_degree(fields: dict, tp: int) -> None:
    """One sentence if `tp` cannot split this model: its heads, key/value heads and feed-forward width must
    divide by tp, and its config must give a plan of plain column and row splits."""
    if tp == 1:
        return
    from torchfleet.plan import library_model

    plan = getattr(library_model.transformers_config(fields, 1), "base_model_tp_plan", None) or {}
    others = sorted({style for style in plan.values() if style not in ("colwise", "rowwise")})
    if not plan or others:
        raise UsageError(
            f"--tp {tp}: {fields['model_type']}'s blocks are not split by plain column and row products"
            + (f" (its config's plan has {', '.join(others)})" if others else "")
            + ", which is the tensor-parallel layout plan traces; plan it with --tp 1"
        )
    heads = fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") or heads
    for name, count in (
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("feed-forward width", fields.get("intermediate_size") or tp),
    ):
        if count % tp:
            raise UsageError(
                f"--tp {tp} does not divide the model's {count} {name}; give a tp that divides"
                f" {heads} heads and {kv_heads} key/value heads"
            )


def apply(model, fields: dict, mesh) -> None:
    """Split `model` over the one-dimensional `mesh` as the module docstring says."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from torchfleet.plan import library_model

    plan = library_model.transformers_config(fields, 1).base_model_tp_plan or {}  # check_degree refused none
    # Outputs stay DTensors (use_local_output=False) wherever the residual stream carries them, so that the
    # residual additions and the norms see the sequence's shards as one tensor.
    inner = model.get_submodule(model.base_model_prefix)
    parallelize_module(
        inner,
        mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
            "norm": SequenceParallel(),
        },
    )
    parallelize_module(
        model,
        mesh,
        {"lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)},
    )
    block_plan = {name.removeprefix("layers.*."): style for name, style in plan.items()}
    split_parents = {name.rpartition(".")[0] for name in block_plan}
    for block in library_model.blocks(model):
        layout: dict[str, ParallelStyle] = {
            name: ColwiseParallel()
            if style == "colwise"
            else RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            for name, style in block_plan.items()
        }
        for name, child in block.named_children():
            if name not in split_parents and "norm" in type(child).__name__.lower():
                layout[name] = SequenceParallel()
        parallelize_module(block, mesh, layout)
        for name in split_parents:
            block.get_submodule(name).register_forward_pre_hook(_gather_sequence, with_kwargs=True)


def _gather_sequence(module, args, kwargs):
    """Before a split attention or feed-forward: the whole sequence, gathered once for all its products (its
    backward is the reduce-scatter of their input gradients)."""
    from torch.distributed.tensor import DTensor, Replicate

    def whole(x):
        return x.redistribute(placements=[Replicate()]) if isinstance(x, DTensor) else x

    if args:
        return (whole(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
    return None


@contextlib.contextmanager
def traceable():
    """Keep the two torch internals named in the module docstring out of the trace (its fake mode and counters)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    concatenate = DeviceMesh.__dict__["_concatenate"]
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def concatenate_real(device_mesh_list):
        with unset_fake_temporarily():
            return concatenate.__func__(device_mesh_list)

    def propagate_apart(self, op_schema):
        # Without any mode of the trace's: DTensor then makes a fake mode of its own, and neither the memory
        # tracker nor the FLOP counter sees its whole-shaped tensors. Leaving only the fake mode counted them
        # as a rank's memory on torch 2.11 (the whole vocabulary's fp32 logits twice, 16.8 GB on Llama 3.1 8B
        # under tp 8); later releases' propagation happens not to reach the tracker.
        with _disable_current_modes():
            return propagate(self, op_schema)

    DeviceMesh._concatenate = staticmethod(concatenate_real)  # pyright: ignore[reportAttributeAccessIssue]
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate_apart
    try:
        yield
    finally:
        DeviceMesh._concatenate = concatenate
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
