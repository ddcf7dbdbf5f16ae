"""What `Fleet.setup` does around the strategy for a model built on the meta device or loaded from a directory.

Before the strategy sees the model: the meta copies of its modules to initialise (weights/deferred.py), the check of the directory's
keys against it (weights/keys.py), and the seed of its initialisation, each the same on every rank, so a
bad directory or a model that cannot be initialised stops every rank alike, before anything is sharded.
A strategy that takes meta models (`Strategy.wraps_meta`) wraps it as it is and each process then gives
its own share storage and values; for the others the whole model is made first, as they hold it whole.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from torchfleet.errors import UsageError
from torchfleet.strategies.base import Strategy
from torchfleet.strategies.blocks import on_meta
from torchfleet.weights.deferred import Recipe, agreed_seed, load, materialise
from torchfleet.weights.files import WeightFiles
from torchfleet.weights.keys import KeyMap, LoadPlan


def held_modules(strategy: Strategy) -> list[nn.Module]:
    """The modules holding this process's tensors under the model's own names: a pipeline's stages, else the model."""
    return list(getattr(strategy, "stage_modules", None) or [strategy.unwrapped()])


class Start:
    """A model's way to its values: from the meta device (`recipe`), from files (`plan`), or both."""

    def __init__(
        self,
        model: nn.Module,
        strategy: Strategy,
        weights: str | os.PathLike | None = None,
        key_map: KeyMap | None = None,
        adapters: str | os.PathLike | None = None,
    ):
        if weights is None and (key_map is not None or adapters is not None):
            raise UsageError("key_map and adapters name what to read from weights=DIR; give weights too")
        self.plan: LoadPlan | None = None
        self.recipe: Recipe | None = None
        self.made: list[str] = []  # the tensors initialised rather than loaded
        if isinstance(model, (list, tuple)):  # mp's stages given by hand: the strategy checks them
            stages = [m for m in model if isinstance(m, nn.Module)]
            if weights is not None or any(on_meta(m) for m in stages):
                raise UsageError(
                    "weights=DIR and a model built on the meta device need the whole model as one nn.Module,"
                    " not a list of stages; give the model and let the strategy cut it"
                )
            self.meta = self.early = False
            return
        self.meta = on_meta(model)
        self.early = self.meta and not strategy.wraps_meta  # made whole before the strategy wraps it
        if not self.meta and weights is None:
            return
        if weights is not None:  # the model's names and shapes, before the strategy changes them
            adapter_files = WeightFiles(adapters, "adapters") if adapters else None
            self.plan = LoadPlan(model, WeightFiles(weights), key_map, adapter_files)
        if self.meta:
            loaded = self.plan.pieces if self.plan is not None else {}
            self.recipe = Recipe(model, agreed_seed(), wanted=(lambda key: key not in loaded) if loaded else None)

    def before(self, model: nn.Module, device: torch.device) -> None:
        if self.early:
            assert self.recipe is not None
            self.made = materialise([model], self.recipe, device, self.plan)

    def after(self, strategy: Strategy, device: torch.device) -> dict | None:
        """Storage and values for this process's share; what it read, mapped and initialised (None: nothing)."""
        made = self.made
        modules = held_modules(strategy)
        if self.recipe is not None and not self.early:
            made = materialise(modules, self.recipe, device, self.plan)
        elif self.plan is not None and not self.meta:
            done: set[int] = set()
            for module in modules:
                for name, tensor in (*module.named_parameters(), *module.named_buffers()):
                    key = self.plan.first.get(name)
                    if key in self.plan.pieces and id(tensor) not in done:
                        done.add(id(tensor))
                        load(tensor, key, self.plan)
        if self.plan is None:
            return (
                None
                if self.recipe is None
                else {"read_bytes": 0, "mapped_bytes": 0, "file_bytes": 0, "initialised": made}
            )
        sources = [f for f in (self.plan.files, self.plan.adapter_files) if f is not None]
        for files in sources:
            files.close()
        return {
            "read_bytes": sum(f.bytes_read for f in sources),
            "mapped_bytes": sum(f.bytes_mapped for f in sources),
            "file_bytes": sum(f.nbytes for f in sources),
            "initialised": made,
        }
