"""One word names one way of running: each is declared once in strategies/registry.py.

The single-process strategies are classes of their own. The multi-process
ones are presets of the parallel dimensions (strategies/dims.py); the class
that runs a preset follows from its degrees (`class_for`). `register` adds
one from a program; a package adds one through an entry point (registry.py).

Each strategy's module is imported on first use: the pipeline strategies pull
in torch.distributed.pipelining and with it torch._dynamo (seconds), which
`torchfleet run` and every worker of a ddp job would otherwise pay at start-up.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Mapping

from torchfleet.errors import choice_error
from torchfleet.strategies import registry
from torchfleet.strategies.base import Runtime, Strategy
from torchfleet.strategies.dims import ParallelDims
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategies.registry import Preset, register


def _load(where: str) -> type[Strategy]:
    """The class `where` names: "module:Class", a bare module name under torchfleet.strategies, a dotted one whole
    (a plug-in's own module, hogwild's room)."""
    module, cls = registry.class_path(where).split(":")
    return getattr(importlib.import_module(module), cls)


def class_for(dims: ParallelDims) -> type[Strategy]:
    """The class that runs these degrees (registry.MESH_CLASSES): pipeline stages, else split parameters,
    else replicas. Tensor and expert parallelism split parameters as FSDP2's shards do: into DTensors, whose
    state one class gathers and scatters (full state dicts, the optimizer rebuilt over the new parameters)."""
    split = any(registry.DIM[n].splits_parameters and v > 1 for n, v in dims.degrees.items())
    return _load(registry.mesh_class(pipelined=dims.pp > 1, split=split))


class _Classes(Mapping[str, type[Strategy]]):
    """name -> strategy class, as the registry names it, importing the class's module when it is first looked up.

    A preset maps to the class its own degrees need; flags that change the
    degrees (``--pp`` on ddp) may need another, which `class_for` gives.
    """

    def __getitem__(self, name: str) -> type[Strategy]:
        return _load(registry.presets()[name].runs_class)

    def __iter__(self) -> Iterator[str]:
        return iter(registry.names())

    def __len__(self) -> int:
        return len(registry.names())


STRATEGIES: Mapping[str, type[Strategy]] = _Classes()


def get_strategy(name: str) -> type[Strategy]:
    if registry.find(name) is None:
        raise choice_error("strategy", name, registry.names())
    return STRATEGIES[name]


def resolve_dims(name: str, world_size: int, nodes: int = 1, options: dict | None = None) -> ParallelDims | None:
    """The degrees strategy `name` runs with on `world_size` processes (None for single-process ones).

    Degree flags (dp_replicate, dp_shard, pp, tp, ep) in `options` override the preset's.
    """
    return dims_of(name, world_size, nodes, StrategyOptions.of(registry.options_for(name, options)))


def dims_of(name: str, world_size: int, nodes: int, typed: StrategyOptions) -> ParallelDims | None:
    """`resolve_dims` for options already under the preset's defaults, sorted into their groups."""
    preset = registry.find(name)
    if preset is None or preset.degrees is None:
        return None
    given = {k: v for k, v in dataclasses.asdict(typed.degrees).items() if v is not None}
    dims = ParallelDims.from_preset(name, world_size, nodes=nodes, **given)
    pipeline = typed.pipeline
    if dims.pp > 1 and (pipeline.schedule, pipeline.stages_per_process, pipeline.microbatches) != (None,) * 3:
        # A schedule that cannot run is refused here, before any process starts, not in every
        # worker. Imported here: it pulls in torch.distributed.pipelining (see above).
        from torchfleet.strategies.pipeline.schedules import check_schedule

        check_schedule(pipeline.schedule, dims.pp, pipeline.stages_per_process, pipeline.microbatches)
    return dims


def data_readers(name: str, world_size: int, options: dict | None = None) -> int:
    """How many of `world_size` processes read different data (the global batch splits among them)."""
    dims = resolve_dims(name, world_size, options=options)
    return dims.dp if dims is not None else world_size


__all__ = [
    "STRATEGIES",
    "Preset",
    "Runtime",
    "Strategy",
    "class_for",
    "data_readers",
    "dims_of",
    "get_strategy",
    "register",
    "resolve_dims",
]
