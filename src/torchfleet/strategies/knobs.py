"""Activation checkpointing and torch.compile on a model's blocks, before any strategy wraps it.

Both work per repeated block (strategies/blocks.py), as torchtitan applies
them: checkpointing a block keeps only its input for backward and computes
its activations again there; compiling a block gives the compiler a graph it
can reuse for every block of the same shape. Both change the block in place
(its forward, not its class or its name), so parameter names, state-dict
keys and the optimizer built over the parameters stay the user's, and DDP,
FSDP2 or a pipeline cut wrap the block as they would the plain one.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchfleet.errors import choice_error
from torchfleet.strategies.blocks import find_blocks

COMPILE_MODES = ("blocks", "model")


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """The module inside ``torch.compile(model)``, and whether it was compiled.

    A compiled wrapper prefixes every state-dict key with ``_orig_mod.`` and
    cannot be cut into stages; the user's module is taken instead and
    compiled again in place once wrapped.
    """
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module):
        return inner, True
    return model, False


def checkpoint_activations(model: nn.Module) -> list[str]:
    """Recompute each block's activations in backward; returns the blocks' names.

    A model without repeated blocks is checkpointed whole.
    """
    blocks = find_blocks(model) or [("", model)]
    for _, block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    return [name or type(model).__name__ for name, _ in blocks]


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # inference: nothing to save for backward
        return forward(*args, **kwargs)
    # Non-reentrant: works with keyword arguments, inputs that need no grad, and FSDP2's hooks.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def compile_model(model: nn.Module, mode: str | bool) -> list[str]:
    """torch.compile each block in place ("blocks", or True), or the whole model ("model")."""
    mode = "blocks" if mode is True else mode
    if mode not in COMPILE_MODES:
        raise choice_error("compile mode", mode, COMPILE_MODES)
    blocks = find_blocks(model) if mode == "blocks" else []
    if not blocks:
        model.compile()
        return [type(model).__name__]
    for _, block in blocks:
        block.compile()
    return [name for name, _ in blocks]
