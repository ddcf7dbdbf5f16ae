"""The strategy registry: one word names one way of running."""

from __future__ import annotations

from torchfleet.errors import choice_error
from torchfleet.strategies.base import Runtime, Strategy
from torchfleet.strategies.ddp import DataParallelDistributed
from torchfleet.strategies.ddp_pipeline import DdpPipeline
from torchfleet.strategies.dp import DataParallelSingleProcess
from torchfleet.strategies.fsdp import FullyShardedDataParallel
from torchfleet.strategies.hogwild import Hogwild
from torchfleet.strategies.mp import ModelParallel
from torchfleet.strategies.pipeline import Pipeline
from torchfleet.strategies.serial import Serial

# In the design's order (../shared/DESIGN.md).
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (Serial, Hogwild, DataParallelSingleProcess, ModelParallel, DataParallelDistributed,
                FullyShardedDataParallel, Pipeline, DdpPipeline)
}
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)


def get_strategy(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise choice_error("strategy", name, STRATEGY_NAMES)
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "STRATEGY_NAMES", "Runtime", "Strategy", "get_strategy"]
