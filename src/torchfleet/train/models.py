"""The built-in models, re-exported from `torchfleet.models` (where they live now), and the optimizers.

Kept so that `from torchfleet.train.models import build_model, cnn, mlp`
(scripts, tests, the examples) keeps working.
"""

from __future__ import annotations

import torch

from torchfleet.models import (  # noqa: F401 - re-exports
    DIGITS_INPUT,
    GPT_PRESETS,
    IMAGE_INPUT,
    MODELS,
    TOKEN_MODELS,
    build_model,
    cnn,
    mlp,
    resnet18,
    resnet50,
    transformer,
)


def build_optimizer(name: str, params, lr: float, device: torch.device | None = None) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, or AdamW; on a GPU AdamW is fused (one kernel for every parameter's update,
    where the default for-each form launches several per group), as torchtitan and nanoGPT run it."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return (
        torch.optim.AdamW(params, lr=lr, fused=True)
        if device is not None and device.type == "cuda"
        else (torch.optim.AdamW(params, lr=lr))
    )
