"""torchtitan's selective activation checkpointing, as plan traces it (`--ac selective`)."""

from __future__ import annotations


def selective_contexts():
    """torchtitan's operator-level policy: keep attention's output and every other matrix product's."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from torchfleet.plan import flash_attention  # noqa: F401 (registers torchfleet::attention)

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.max.default, torch.ops.torchfleet.attention.default}  # plan/flash_attention.py's
    for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            keep.add(getattr(aten, name).default)
    products = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            products[phase] += 1
        if func in keep and not (func == aten.mm.default and products[phase] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
