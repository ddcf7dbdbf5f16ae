"""Built-in models, each an ``nn.Sequential`` of plain layers.

Sequential on purpose: the model-parallel and pipeline strategies cut a
Sequential into consecutive stages, and no layer keeps per-batch statistics
(no BatchNorm), so a data-parallel run computes exactly what a single process
computes on the same global batch.
"""

from __future__ import annotations

import math

from torch import nn

from torchfleet.errors import choice_error

MODELS = ("mlp", "cnn")


def mlp(in_shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10, hidden: int = 128) -> nn.Sequential:
    features = math.prod(in_shape)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def cnn(in_shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10, width: int = 32) -> nn.Sequential:
    """Two 3x3 convolutions and a 2x2 pool, sized for 8x8 digits (any HxW works)."""
    channels, height, width_px = in_shape
    flat = (width * 2) * (height // 2) * (width_px // 2)
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width * 2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


_BUILDERS = {"mlp": mlp, "cnn": cnn}


def build_model(name: str, in_shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10) -> nn.Module:
    if name not in _BUILDERS:
        raise choice_error("model", name, MODELS)
    return _BUILDERS[name](in_shape, num_classes)
