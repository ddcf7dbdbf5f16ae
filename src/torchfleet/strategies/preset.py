"""What a strategy's declaration (`Preset`) says, and the words each of its fields takes.

strategies/registry.py declares every strategy with one of these; this module holds the
dataclass, its vocabularies (how it starts, what its BatchNorm layers see, what doctor
checks, what its replica groups exchange), the mesh's dimension names and the classes
that run the mesh's presets. No torch here: the launcher and `--help` read it before
torch is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torchfleet.errors import UsageError


@dataclass(frozen=True)
class Dim:
    """One dimension of the mesh, declared once: its degree flag (`--` and the name, `_` as `-`) and `Degrees`'
    field are made from it, and ParallelDims, the mesh, which processes read which data, which class runs a
    preset and what FSDP2 shards over all follow from these fields.

    `reads_data`: its ranks read different data (the global batch splits over them). `splits`: its ranks hold
    the parameters split (FSDP2's shards, tensor parallelism's pieces, experts), so the class that holds DTensors
    runs it. `sharded_over`: FSDP2 shards over it beside dp_shard, the two flattened into one dimension.
    `borrowed`: it takes data-parallel ranks instead of multiplying the processes (ep). `shown`: the degrees'
    arithmetic names it at 1 too. `applies`: "module:function" under torchfleet.strategies, for a dimension whose
    parallelism needs only the model and its dimension of the mesh: `parallelize` calls it, after tensor and
    expert parallelism and before FSDP2, as ``function(model, mesh, dims)``, and a callable it returns is entered
    around each step's forward and backward as ``callable(inputs, targets)`` (a context manager)."""

    name: str
    help: str
    reads_data: bool = False
    splits: bool = False
    sharded_over: bool = False
    borrowed: bool = False
    shown: bool = False
    applies: str | None = None

    @property
    def splits_parameters(self) -> bool:
        """Its ranks hold the parameters split, by its own parallelism or by FSDP2 sharding over it: the class that
        holds DTensors runs a degree of it above 1."""
        return self.splits or self.sharded_over


# The mesh's dimensions, torchtitan's names, in the mesh's row-major order: a preset's degrees, the DeviceMesh's
# dimensions, plan's rows and the degree flags (--dp-replicate, ...) are keyed by them. tp and ep are also presets'
# names: each alone.
DP_REPLICATE, DP_SHARD, PP, TP = "dp_replicate", "dp_shard", "pp", "tp"
# Expert parallelism borrows its processes from the data-parallel ones instead of multiplying them
# (torchtitan's ep): a preset may name it beside the others, None meaning every data-parallel rank.
EP = "ep"
DIMS = (
    Dim(
        DP_REPLICATE,
        "replicas (the dp_replicate degree); hsdp defaults to 2, or one per machine",
        reads_data=True,
        shown=True,
    ),
    Dim(
        DP_SHARD,
        "shards per replica (the dp_shard degree); the product of the degrees is the number of processes",
        reads_data=True,
        splits=True,
        shown=True,
    ),
    Dim(PP, "pipeline stages (the pp degree): ddp+pipeline and fsdp+pipeline default to 2", shown=True),
    Dim(
        TP,
        "tensor-parallel processes per group (the tp degree): fsdp+tp defaults to 2;"
        " needs a model with a plan (the built-in gpt has one)",
        splits=True,
    ),
    Dim(
        EP,
        "expert-parallel processes (the ep degree): each mixture-of-experts layer's experts are split over groups"
        " of this many data-parallel processes, which send tokens to their experts with all-to-all; it borrows"
        " processes, not multiplies them (ep: every process; fsdp+ep defaults to 2)",
        splits=True,
        borrowed=True,
    ),
)
DIM = {d.name: d for d in DIMS}
DIM_NAMES = tuple(d.name for d in DIMS if not d.borrowed)
BORROWED_DIMS = tuple(d.name for d in DIMS if d.borrowed)
# How a strategy's processes start: one process; torchrun's agent, one worker per rank; hogwild's workers,
# spawned by its own process around shared memory; replica groups meeting under torchft.
LAUNCHES = ("one process", "agent", "spawn", "replica groups")
# What a strategy's BatchNorm layers normalise with (strategies/batchnorm.py words each): the whole batch (the
# reference), each process's share, each GPU's chunk in one process, a pipeline's micro-batches on its stages,
# one process's micro-batches on its devices, each worker's own batch in shared memory.
BATCHNORMS = ("whole batch", "shares", "chunks", "stage micro-batches", "micro-batches", "own batches")
# What doctor checks for a class of its own (doctor.py): one device; cores for workers sharing memory;
# GPUs one process splits batches over; devices one process places stages on.
CHECKS = ("one device", "worker cores", "split batch", "placed stages")
# What replica groups that train apart exchange when they meet, every --sync-every steps (replica_groups/): how far
# each moved since the last meeting, averaged and applied by an outer optimizer (DiLoCo's pseudo-gradients);
# or the weights themselves, averaged (local SGD).
MEETINGS = ("pseudo-gradients", "weights")
# The classes that run the mesh's presets, by what the degrees hold: pipeline stages, else parameters split across
# processes (FSDP2's shards, tensor parallelism's pieces or experts: DTensors, whose state one class gathers and
# scatters), else whole replicas. "module:Class" under torchfleet.strategies, or a full dotted module.
MESH_CLASSES = {
    "stages": "torchfleet.strategies.pipeline.strategy:Pipeline",
    "split": "fsdp:SplitParameters",
    "replicas": "ddp:DataParallelDistributed",
}


@dataclass(frozen=True)
class Preset:
    """One strategy. `degrees` (mesh presets): the degree each dimension takes, None for "the processes
    left over" (exactly one). `runs`: "module:Class" under torchfleet.strategies, or a full dotted module
    ("torchfleet.hogwild.worker:Hogwild"), for a strategy that is a class of its own rather than degrees.
    `defaults`: strategy options it sets unless a flag does.
    `across_nodes`: the degree that takes the number of machines when there are several (hsdp's
    replicas). `cost`: how plan predicts it: "mesh" (from the degrees), "meetings" (replica groups meeting
    every few steps), "one" (one process), "stages here" (one process, micro-batches through stages on its devices;
    planned on this machine only), "here" (one process, planned on this machine only), or None (not planned).
    `batchnorm`: what its BatchNorm layers normalise with (one of BATCHNORMS; None: nothing is said).
    `checks`: what doctor checks for a class of its own (one of CHECKS; None: its launch or degrees say).
    `traced`: plan runs its setup and step on fake tensors to trace its memory (plan/layout_trace.py).
    `group_of_one`: a launcher's one process for it is a process group of one, as torch runs `torchrun -n 1`
    (NCCL on a GPU box's one GPU); any other strategy alone has nothing to share and runs serial.
    `meets`: what its replica groups exchange when they meet every few steps (one of MEETINGS), for launch
    "replica groups"; None: it does not meet (its gradients are averaged every step, or it runs alone)."""

    name: str
    summary: str
    needs: str
    degrees: Mapping[str, int | None] | None = None
    runs: str | None = None
    defaults: Mapping[str, object] = field(default_factory=dict)
    launch: str = "agent"
    across_nodes: str | None = None
    cost: str | None = "mesh"
    batchnorm: str | None = None
    checks: str | None = None
    traced: bool = False
    group_of_one: bool = False
    meets: str | None = None

    def __post_init__(self) -> None:
        if (self.degrees is None) == (self.runs is None):
            raise UsageError(f"strategy {self.name!r}: give its degrees or the class that runs it, one of the two")
        for what, value, choices in (("launch", self.launch, LAUNCHES), ("batchnorm", self.batchnorm, BATCHNORMS)):
            if value is not None and value not in choices:
                raise UsageError(f"strategy {self.name!r}: {what} {value!r} is not one of {', '.join(choices)}")
        if self.checks is not None and self.checks not in CHECKS:
            raise UsageError(f"strategy {self.name!r}: checks {self.checks!r} is not one of {', '.join(CHECKS)}")
        if self.meets is not None and self.meets not in MEETINGS:
            raise UsageError(f"strategy {self.name!r}: meets {self.meets!r} is not one of {', '.join(MEETINGS)}")
        if self.degrees is not None:
            unknown = [d for d in self.degrees if d not in DIM_NAMES + BORROWED_DIMS]
            if unknown or [self.degrees[d] for d in self.degrees if d in DIM_NAMES].count(None) != 1:
                raise UsageError(
                    f"strategy {self.name!r}: degrees {dict(self.degrees)} must name only"
                    f" {', '.join(DIM_NAMES + BORROWED_DIMS)}, exactly one of {', '.join(DIM_NAMES)} None"
                    " (the processes left over)"
                )

    @property
    def mesh(self) -> bool:
        return self.degrees is not None

    @property
    def splits_layers(self) -> bool:
        """Tensor parallelism: the layers of the model's plan split across processes, so it needs a plan."""
        return TP in (self.degrees or {})

    @property
    def splits_experts(self) -> bool:
        """Expert parallelism: each mixture-of-experts layer's experts split, so it needs a model with experts."""
        return EP in (self.degrees or {})

    @property
    def shards(self) -> bool:
        """Its parameters are split (FSDP2's shards, tensor parallelism or experts), whatever the degrees come to."""
        return any(DIM[d].splits_parameters for d in self.degrees or ())

    @property
    def shares_gpus(self) -> bool:
        """Its processes may share GPUs, their collectives over Gloo: only whole replicas' all-reduce (DDP's)
        runs there."""
        return set(self.degrees or ()) == {DP_REPLICATE}

    @property
    def runs_class(self) -> str:
        """Where the class that runs it is ("module:Class"): its own, or for the mesh's degrees the one they need."""
        if self.degrees is None:
            return str(self.runs)
        return mesh_class(pipelined=PP in self.degrees, split=self.shards)

    @property
    def min_processes(self) -> int:
        """The fewest processes that show every dimension it names: 2 each."""
        if self.degrees is None:
            return 1
        return 2 ** len([d for d in self.degrees if d in DIM_NAMES])


def mesh_class(pipelined: bool, split: bool) -> str:
    """The class that runs degrees with a pipeline (`pipelined`) or parameters split across processes (`split`)."""
    return MESH_CLASSES["stages" if pipelined else "split" if split else "replicas"]


def class_path(where: str) -> str:
    """`where` ("module:Class" under torchfleet.strategies, or a full dotted module) as "package.module:Class"."""
    module, cls = where.split(":")
    return f"{module if '.' in module else f'torchfleet.strategies.{module}'}:{cls}"
