"""The built-in models of `torchfleet train` and `torchfleet bench`, by name.

- mlp, cnn, transformer (digits.py): small ``nn.Sequential`` classifiers for
  8x8 digits; every strategy computes exactly what serial computes on them.
- gpt (gpt.py): a decoder-only transformer from a few hundred thousand
  parameters (``tiny``) to GPT-2 small (``gpt2``, 124M); it reads token
  sequences, not images, and ships its tensor-parallel plan.
- gpt-moe (gpt.py, moe.py): gpt with every block's MLP a mixture of 8
  experts, top-2, in transformers' expert layout (for expert parallelism).
- resnet18, resnet50 (resnet.py): torchvision's module tree and keys, no
  torchvision needed.

This package knows torch and nothing of torchfleet's strategies: anyone can
build these models and hand them to a Fleet.
"""

from __future__ import annotations

from torch import nn

from torchfleet.errors import choice_error
from torchfleet.models.digits import DIGITS_INPUT, cnn, mlp, transformer
from torchfleet.models.gpt import GPT, GPTConfig, gpt, gpt_config, gpt_moe, lm_loss
from torchfleet.models.gpt import PRESETS as GPT_PRESETS
from torchfleet.models.resnet import ResNet, resnet18, resnet50

MODELS = ("mlp", "cnn", "transformer", "gpt", "gpt-moe", "resnet18", "resnet50")
TOKEN_MODELS = ("gpt", "gpt-moe")  # these read token sequences (B, T) and predict the next token at every position
EXPERT_MODELS = ("gpt-moe",)  # these hold a mixture of experts, which ep and fsdp+ep split
IMAGE_MODELS = ("resnet18", "resnet50")  # these read 3-channel images of any size (224 x 224 by default)
IMAGE_INPUT = (3, 224, 224)  # ImageNet's, as in the seed notebook's ResNet-50 benchmark

_IMAGE_BUILDERS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "resnet18": resnet18, "resnet50": resnet50}

__all__ = [
    "DIGITS_INPUT",
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "IMAGE_INPUT",
    "IMAGE_MODELS",
    "MODELS",
    "ResNet",
    "TOKEN_MODELS",
    "EXPERT_MODELS",
    "build_model",
    "cnn",
    "gpt",
    "gpt_config",
    "gpt_moe",
    "lm_loss",
    "mlp",
    "resnet18",
    "resnet50",
    "transformer",
]


def build_model(
    name: str, in_shape: tuple[int, ...] = DIGITS_INPUT, num_classes: int = 10, *, gpt_preset: str = "tiny"
) -> nn.Module:
    """The model `name`. Image models take `in_shape` (channels first) and `num_classes`;
    gpt and gpt-moe take `gpt_preset` (one of GPT_PRESETS) instead, their vocabulary and length being
    their own."""
    if name not in MODELS:
        raise choice_error("model", name, MODELS)
    if name == "gpt":
        return gpt(gpt_preset)
    if name == "gpt-moe":
        return gpt_moe(gpt_preset)
    return _IMAGE_BUILDERS[name](in_shape, num_classes)
