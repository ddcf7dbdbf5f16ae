"""An adapters-only save: what peft's save_pretrained writes, from a model any strategy holds.

A strategy shards or cuts the model it wraps, so peft's save_pretrained called on it would
write one rank's pieces, or fail on a pipeline stage that lacks some layers. Strategy.setup
keeps a copy of a peft model's structure on the meta device (strategies/blocks.adapter_skeleton);
its save_pretrained, handed the full state dict the strategy gathers for save_model, picks the
adapters' keys itself (get_peft_model_state_dict) and writes adapter_config.json and
adapter_model.safetensors under peft's names, so ``PeftModel.from_pretrained(base, path)``
loads them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, cast

from torch import nn

from torchfleet.errors import UsageError


def writer(skeleton: nn.Module | None) -> Callable[[dict, Path], None]:
    """save_model's writer for `adapters_only`: (full state dict, directory) -> None, on the main rank.

    Called on every rank before the state is gathered, so a model without adapters is refused
    on all of them alike.
    """
    if skeleton is None:
        raise UsageError(
            "save_model(adapters_only=True) saves peft's adapters and this model has none (it is no peft"
            " PeftModel); save the whole model with save_model(path)"
        )

    def write(state: dict, directory: Path) -> None:
        # peft writes file by file into the directory; written beside it first and moved in file by file,
        # a crash leaves the previous save's files whole (each os.replace is atomic).
        partial = directory.with_name(f".{directory.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        save_pretrained = cast(Callable[..., None], skeleton.save_pretrained)  # peft's method, not a submodule
        save_pretrained(str(partial), state_dict=state)
        directory.mkdir(parents=True, exist_ok=True)
        for written in sorted(partial.rglob("*")):
            target = directory / written.relative_to(partial)
            if written.is_dir():
                target.mkdir(exist_ok=True)
            else:
                os.replace(written, target)
        shutil.rmtree(partial)

    return write
