"""`train --hf-model DIR` and `train --model MODULE:FUNCTION`: the user's language model in the built-in loop.

The model is built on the meta device (`Fleet.init_module`), so no process holds more of it than its
strategy gives it: a Hugging Face directory's model from its config.json, its weights read by each
process for its own share at setup (`weights=`); the user's function's model initialised as it
initialises itself. Either reads the built-in text (bytes, a vocabulary of 256) and is scored as gpt
is: the mean loss per token over its logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torchfleet.errors import UsageError
from torchfleet.models.user import user_function

TEXT_VOCAB = 256  # train/text.py's tokens are bytes


def check_hf_model(directory: str) -> None:
    """One sentence, before any process starts, for a --hf-model that is no model directory."""
    path = Path(directory)
    if not path.is_dir():
        raise UsageError(f"--hf-model {directory!r} is not a directory; give a Hugging Face model's directory")
    if not (path / "config.json").is_file():
        raise UsageError(f"--hf-model {directory!r} holds no config.json; give a directory that save_pretrained wrote")


def logits_of(output) -> torch.Tensor:
    """A language model's logits: the tensor it returns, or a transformers output's `logits`."""
    return output if isinstance(output, torch.Tensor) else output.logits


def build(fleet, hf_model: str | None, model: str) -> tuple[nn.Module, str | None, int]:
    """(the model on the meta device, the directory its weights come from or None, its context length)."""
    if hf_model is not None:
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise UsageError(
                "--hf-model needs transformers to build the model from its config.json, which is not installed"
                " here: pip install 'torchfleet[hf]'"
            ) from None
        config = AutoConfig.from_pretrained(hf_model)
        config.use_cache = False  # a training forward keeps no key/value cache
        vocab = getattr(config, "vocab_size", 0)
        if vocab < TEXT_VOCAB:
            raise UsageError(
                f"--hf-model {hf_model}'s vocabulary of {vocab} tokens is smaller than --data text's {TEXT_VOCAB}"
                " bytes; give a model with a vocabulary of 256 or more"
            )
        with fleet.init_module():
            net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return net, hf_model, int(getattr(config, "max_position_embeddings", 0) or 0)
    with fleet.init_module():
        made = user_function(model)()
    net = made[0] if isinstance(made, tuple) and made else made
    if not isinstance(net, nn.Module):
        raise UsageError(f"--model {model!r} returned {type(made).__name__}; return the torch.nn.Module to train")
    config = getattr(net, "config", None)
    return net, None, int(getattr(config, "max_position_embeddings", 0) or 0)


def vocabulary(model: nn.Module) -> int:
    """The user's model's vocabulary, which --data PATH's tokens are checked against: its config's vocab_size,
    else the output features of its last linear layer (the head)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    heads = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not heads:
        raise UsageError(f"--data PATH: {type(model).__name__} has no vocabulary to check the tokens against")
    return heads[-1].out_features
