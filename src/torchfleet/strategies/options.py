"""Every strategy option declared once, in typed groups, one per family (no torch here: the CLI reads it).

`train` and `bench` make their strategy flags from these declarations, `Fleet(...)` takes the same
names as keywords, and `StrategyOptions.of` sorts what was given into its groups, so the code that
needs the pipeline's options reads `options.pipeline.schedule` instead of picking keys out of a
dict. A name no group declares is kept aside (`undeclared`), for the strategy class to refuse
in its own words ("option 'x' does not apply to strategy 'ddp'; it takes ...").

Each strategy class is built with the whole `StrategyOptions` and reads the groups it takes
(`Strategy.takes` names them); a mesh class's degrees arrive settled, as its `ParallelDims`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torchfleet.strategies.preset import DIMS


def _option(kind: type, text: str | None) -> Any:
    """One option: None unless given. `text` is its flag's help; None for a keyword-only option (a dict)."""
    return field(default=None, metadata={"kind": kind, "help": text})


# The mesh's degrees (strategies/dims.py), one field per dimension its declaration names (strategies/preset.py's
# DIMS), each None unless given: the preset's then.
Degrees = dataclasses.make_dataclass("Degrees", [(d.name, int | None, _option(int, d.help)) for d in DIMS], frozen=True)
Degrees.__module__ = __name__  # pickled with the spec the launcher carries to its workers


@dataclass(frozen=True)
class PipelineOptions:
    """How a pipeline (and mp) cuts the model and runs its micro-batches."""

    microbatches: int | None = _option(
        int,
        "mp, pipeline, ddp+pipeline: micro-batches per batch, so stages overlap (pipelines default to 2 per"
        " stage, or fewer that divide the batch; fewer still for 1x1 convolutions on one-thread CPU"
        " processes, to keep 16 samples)",
    )
    schedule: str | None = _option(
        str,
        "pipelines: gpipe, 1f1b (one stage per process), interleaved-1f1b, looped-bfs, interleaved-zb"
        " (several) or zbv (zero bubble, 2 in a V) where the installed torch has them (default 1f1b, or"
        " interleaved-1f1b with --stages-per-process 2 or more)",
    )
    stages_per_process: int | None = _option(
        int,
        "pipelines: stages each process holds, the model cut into processes x this (default 1; 2 or more"
        " for interleaved-1f1b, looped-bfs and interleaved-zb, exactly 2 for zbv)",
    )
    split_points: str | None = _option(
        str,
        "pipelines and mp: the modules where stages after the first begin, comma-separated, e.g."
        " transformer.h.2 (default: between repeated blocks, balanced)",
    )


@dataclass(frozen=True)
class ShardingOptions:
    """What FSDP2 shards one unit at a time."""

    fsdp_units: str | None = _option(
        str,
        "fsdp, hsdp, fsdp+pipeline: block classes FSDP2 shards one by one, comma-separated (default: the"
        " blocks of the model's largest ModuleList)",
    )


@dataclass(frozen=True)
class ExpertOptions:
    """Which modules expert parallelism splits, where finding them in the model is not enough."""

    experts: str | None = _option(
        str,
        "ep, fsdp+ep: the classes of the modules holding the experts, comma-separated (default: those found,"
        " modules whose weights stack one matrix per expert, as transformers' MoE models and gpt-moe hold them)",
    )


@dataclass(frozen=True)
class TensorParallelOptions:
    """tp's plan where the model's own is not the one wanted: {module name pattern: ParallelStyle}."""

    tp_plan: dict | None = _option(dict, None)


@dataclass(frozen=True)
class ReplicationOptions:
    """What data parallel replicas do beside averaging gradients."""

    sync_batchnorm: bool | None = _option(
        bool,
        "ddp, fsdp, hsdp: BatchNorm normalises with the whole batch's statistics, all-reduced across"
        " processes (CPU and GPU), as serial does",
    )
    find_unused_parameters: bool | None = _option(
        bool,
        "ddp: let DDP find parameters the forward does not use (a cost every step; without it such a model"
        " stops with their names)",
    )


@dataclass(frozen=True)
class CompressionOptions:
    """ddp's communication hooks."""

    grad_compression: str | None = _option(str, "ddp: none, fp16, bf16 or powersgd (DDP communication hooks)")
    powersgd_rank: int | None = _option(int, "ddp with --grad-compression powersgd: the low rank (default 2)")


@dataclass(frozen=True)
class ReplicaGroupOptions:
    """diloco and localsgd: how often the replica groups meet, and diloco's outer optimizer
    (replica_groups/sync_methods.py validates them and holds the defaults)."""

    sync_every: int | None = _option(
        int,
        "diloco, localsgd: steps each replica group takes on its own between meetings (default 100: 1%% of"
        " ddp's exchanges, and several meetings in a short run)",
    )
    outer_lr: float | None = _option(
        float,
        "diloco: the outer SGD's learning rate on the averaged change of the weights (default 0.7, the DiLoCo paper's)",
    )
    outer_momentum: float | None = _option(
        float, "diloco: the outer SGD's Nesterov momentum (default 0.9, the DiLoCo paper's)"
    )


@dataclass(frozen=True)
class SingleProcessOptions:
    """The one-process strategies' own: mp's devices, hogwild's way of sharing memory."""

    devices: str | None = _option(str, "mp: comma-separated devices for the stages, e.g. cuda:0,cuda:1 or cpu,cpu")
    sharing_strategy: str | None = _option(str, "hogwild: file_descriptor or file_system (default: the platform's)")


@dataclass(frozen=True)
class StrategyOptions:
    """A strategy's options, sorted into their families."""

    degrees: Any = Degrees()  # a Degrees, a class made from the declarations, so not a type to a checker
    pipeline: PipelineOptions = PipelineOptions()
    sharding: ShardingOptions = ShardingOptions()
    experts: ExpertOptions = ExpertOptions()
    tensor_parallel: TensorParallelOptions = TensorParallelOptions()
    replication: ReplicationOptions = ReplicationOptions()
    compression: CompressionOptions = CompressionOptions()
    replica_groups: ReplicaGroupOptions = ReplicaGroupOptions()
    single_process: SingleProcessOptions = SingleProcessOptions()
    undeclared: tuple[tuple[str, Any], ...] = ()  # names no group declares: the class refuses them

    @classmethod
    def of(cls, given: dict[str, Any]) -> StrategyOptions:
        """`given` (flags or Fleet keywords; None means not given) sorted into the groups."""
        groups = {
            name: kind(**{o.name: given[o.name] for o in dataclasses.fields(kind) if given.get(o.name) is not None})
            for name, kind in GROUPS.items()
        }
        undeclared = tuple((k, v) for k, v in given.items() if k not in NAMES and v is not None)
        return cls(**groups, undeclared=undeclared)

    def given(self) -> dict[str, Any]:
        """Every option given, degrees included, as one flat mapping (the order of the declarations)."""
        flat = {
            name: value
            for group in self._groups()
            for name, value in dataclasses.asdict(group).items()
            if value is not None
        }
        return {**flat, **dict(self.undeclared)}

    def _groups(self) -> list:
        return [getattr(self, name) for name in GROUPS]


# StrategyOptions' groups, by field, in the order their flags are listed.
GROUPS: dict[str, type] = {
    f.name: type(f.default) for f in dataclasses.fields(StrategyOptions) if f.name != "undeclared"
}


def _declared() -> list[dataclasses.Field]:
    return [option for kind in GROUPS.values() for option in dataclasses.fields(kind)]


NAMES = tuple(f.name for f in _declared())


def flags() -> list[tuple[str, type, str]]:
    """(--flag, type, help) of every option a command line can give (a dict is Fleet's keyword only)."""
    return [
        ("--" + f.name.replace("_", "-"), f.metadata["kind"], f.metadata["help"])
        for f in _declared()
        if f.metadata["help"] is not None
    ]
