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
import gc

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


def _compiled_after_setup(module: nn.Module) -> bool:
    """Whether a ``torch.compile(module)`` wrapper of `module` is alive (its user holds it).

    Such a wrapper is a new module around the one setup returned, and
    ``train_step`` calls the module it has: the compiled code would never
    run. Found through the garbage collector's referrers (the wrapper keeps
    `module` in its ``_modules`` dict); a scan of every tracked object, so
    call it once, not per step.
    """
    # wrapper -> its instance dict (or inline attributes) -> its _modules dict -> module
    frontier = [h for h in gc.get_referrers(module) if isinstance(h, dict) and h.get("_orig_mod") is module]
    for _ in range(2):
        above = [r for h in frontier for r in gc.get_referrers(h)]
        if any(isinstance(r, nn.Module) and getattr(r, "_orig_mod", None) is module for r in above):
            return True
        frontier = [r for r in above if isinstance(r, dict)]
    return False


def adopt_late_compile(module: nn.Module) -> bool:
    """Compile `module` in place if a ``torch.compile`` wrapper of it is alive; True if so.

    ``nn.Module.compile`` with torch's default options: the wrapper's own
    options cannot be read back (call ``model.compile(...)`` for others).
    """
    if not _compiled_after_setup(module):
        return False
    module.compile()
    return True


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
