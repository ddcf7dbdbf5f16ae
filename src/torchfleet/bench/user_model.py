"""`torchfleet bench --model MODULE:FUNCTION`: the user's own model through the same cells.

FUNCTION takes no arguments and returns the model, or ``(model, make_batch)``,
or ``(model, make_batch, loss_fn)``. ``make_batch(n)`` returns ``(inputs,
targets)`` for a batch of n samples (on the CPU; the cell moves them); the
loss defaults to cross-entropy. Without a batch maker the batch is n random
8x8 one-channel images, the built-in models' input, with as many classes as
the model has outputs. MODULE is imported as Python imports it from the
current directory, or given as a path: ``my_models/net.py:build``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from torchfleet.errors import UsageError
from torchfleet.models import DIGITS_INPUT
from torchfleet.models.user import is_user_model, user_function  # noqa: F401 (is_user_model: bench and plan ask here)

DEFAULT_INPUT = DIGITS_INPUT


def build(name: str) -> tuple[nn.Module, Callable[[int], tuple], Callable]:
    """(model, make_batch, loss_fn) from the user's function."""
    made = user_function(name)()
    parts = made if isinstance(made, tuple) else (made,)
    model, make_batch, loss_fn = (*parts, None, None)[:3]
    if not isinstance(model, nn.Module) or not 1 <= len(parts) <= 3:
        raise UsageError(
            f"--model {name!r} returned {type(made).__name__}; return a torch.nn.Module, or"
            " (model, make_batch) or (model, make_batch, loss_fn)"
        )
    return model, make_batch or _default_batches(model, name), loss_fn or nn.functional.cross_entropy


def build_on_meta(name: str) -> nn.Module:
    """The user's model built on the meta device (shapes, no storage): what `plan` reads of a model too big to
    build here. A builder that makes real tensors itself still makes them (torch.device("meta") is the default
    device, not a rule)."""
    with torch.device("meta"):
        made = user_function(name)()
    model = made[0] if isinstance(made, tuple) and made else made
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"--model {name!r} returned {type(made).__name__}; return a torch.nn.Module, or"
            " (model, make_batch) or (model, make_batch, loss_fn)"
        )
    return model


def _default_batches(model: nn.Module, name: str) -> Callable[[int], tuple]:
    try:
        with torch.no_grad():
            classes = model(torch.rand(2, *DEFAULT_INPUT)).shape[-1]
    except Exception as exc:  # the user's model: any error means "not this input"
        raise UsageError(
            f"--model {name!r} does not take a batch of {DEFAULT_INPUT} images ({type(exc).__name__});"
            " return (model, make_batch) with make_batch(n) -> (inputs, targets)"
        ) from None
    generator = torch.Generator().manual_seed(0)
    return lambda n: (
        torch.rand(n, *DEFAULT_INPUT, generator=generator),
        torch.randint(0, classes, (n,), generator=generator),
    )
