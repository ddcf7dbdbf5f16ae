"""The strategy registry: one word names one way of running.

Each strategy's module is imported on first use: the pipeline strategies pull
in torch.distributed.pipelining and with it torch._dynamo (about 2 s), which
`torchfleet run` and every worker of a ddp job would otherwise pay at start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from torchfleet.errors import choice_error
from torchfleet.strategies.base import Runtime, Strategy

# In the design's order (../shared/DESIGN.md): name -> (module, class).
_WHERE = {
    "serial": ("serial", "Serial"),
    "hogwild": ("hogwild", "Hogwild"),
    "dp": ("dp", "DataParallelSingleProcess"),
    "mp": ("mp", "ModelParallel"),
    "ddp": ("ddp", "DataParallelDistributed"),
    "fsdp": ("fsdp", "FullyShardedDataParallel"),
    "pipeline": ("pipeline", "Pipeline"),
    "ddp+pipeline": ("ddp_pipeline", "DdpPipeline"),
}


class _Registry(Mapping[str, type[Strategy]]):
    """name -> strategy class, importing the class's module when it is first looked up."""

    def __getitem__(self, name: str) -> type[Strategy]:
        module, cls = _WHERE[name]
        return getattr(importlib.import_module(f"torchfleet.strategies.{module}"), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(_WHERE)

    def __len__(self) -> int:
        return len(_WHERE)


STRATEGIES: Mapping[str, type[Strategy]] = _Registry()
STRATEGY_NAMES: tuple[str, ...] = tuple(_WHERE)


def get_strategy(name: str) -> type[Strategy]:
    if name not in _WHERE:
        raise choice_error("strategy", name, STRATEGY_NAMES)
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "STRATEGY_NAMES", "Runtime", "Strategy", "get_strategy"]
