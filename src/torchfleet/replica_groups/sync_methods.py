"""diloco and localsgd: what they are, their options and their defaults (no torch here: the launcher reads it).

Both train each replica group on its own for `sync_every` steps with the
user's optimizer (the inner one), then meet once, instead of averaging every
gradient every step as ddp does across machines:

- localsgd averages the groups' weights (Lin et al., "Don't Use Large
  Mini-Batches, Use Local SGD", 2018);
- diloco averages how far each group moved since the last meeting (the
  pseudo-gradient) and applies it with an outer SGD with Nesterov momentum
  (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models", 2023: AdamW inside, outer learning rate 0.7, momentum 0.9).

Inside a group the processes are data parallel (ddp); across groups the
meetings are torchft's `DiLoCo` and `LocalSGD` under its Manager, so a group
that is lost between meetings never holds the others up.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchfleet.errors import UsageError
from torchfleet.strategies import registry

# The paper meets every 500 steps over runs of tens of thousands; torchfleet's runs are often a few
# hundred steps, where 500 would never meet. 100 keeps the meetings to 1% of ddp's exchanges (each
# sends the whole model once, as one ddp step does) and still meets several times in a short run.
DEFAULT_SYNC_EVERY = 100
DEFAULT_OUTER_LR = 0.7  # the DiLoCo paper's
DEFAULT_OUTER_MOMENTUM = 0.9  # the DiLoCo paper's, Nesterov


def methods() -> tuple[str, ...]:
    """The strategies whose replica groups meet every few steps: those whose presets say what they exchange."""
    return tuple(name for name, preset in registry.presets().items() if preset.meets is not None)


@dataclass(frozen=True)
class SyncOptions:
    method: str
    sync_every: int = DEFAULT_SYNC_EVERY
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM

    def __post_init__(self) -> None:
        if self.method not in methods():
            raise UsageError(
                f"{self.method!r} is not a method that meets every few steps; use one of {', '.join(methods())}"
            )
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise UsageError(
                f"--sync-every {self.sync_every} must be a whole number of steps, at least 1"
                f" (default {DEFAULT_SYNC_EVERY})"
            )
        if not self.outer_step and (self.outer_lr, self.outer_momentum) != (DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM):
            raise UsageError(
                f"{self.method} averages the weights and has no outer optimizer; --outer-lr and --outer-momentum"
                " are diloco's"
            )
        if not self.outer_lr > 0:
            raise UsageError(
                f"--outer-lr {self.outer_lr} must be a positive number (the DiLoCo paper's is {DEFAULT_OUTER_LR})"
            )
        if not 0 <= self.outer_momentum < 1:
            raise UsageError(
                f"--outer-momentum {self.outer_momentum} must be at least 0 and below 1 (the"
                f" DiLoCo paper's is {DEFAULT_OUTER_MOMENTUM})"
            )

    @property
    def outer_step(self) -> bool:
        """The groups exchange pseudo-gradients, which an outer optimizer applies (diloco); else they average
        their weights (localsgd)."""
        return outer_step(self.method)

    def describe(self) -> str:
        if not self.outer_step:
            return f"{self.method}: the groups average their weights every {self.sync_every} steps"
        return (
            f"{self.method}: the groups meet every {self.sync_every} steps; outer SGD lr {self.outer_lr:g},"
            f" Nesterov momentum {self.outer_momentum:g}"
        )


def outer_step(method: str) -> bool:
    """Whether `method`'s meetings step an outer optimizer (--outer-lr, --outer-momentum): its preset's groups
    exchange pseudo-gradients."""
    return registry.presets()[method].meets == "pseudo-gradients"


def refuse_alone(method: str, groups: int) -> None:
    """Both need two replica groups at least: one has no one to meet."""
    if groups < 2:
        raise UsageError(
            f"{method} on one process (or one replica group) has no one to meet; run it on 2 or"
            f" more processes (-n 2 on one machine, or --nnodes 2 and more), or use serial"
        )
