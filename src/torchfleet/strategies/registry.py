"""Every strategy declared once: its name, degrees, defaults, help, how it starts and how plan costs it.

`train --strategy`, `Fleet(strategy=...)`, `bench --strategies`, `plan --strategies`,
`doctor`'s list, `train --help` and the README's table all read this module, so a
new strategy is one `Preset` here, or one from another package: a distribution
that declares an entry point in the group ``torchfleet.strategies`` whose object
is a `Preset` (or a list of them) is registered the first time any name is looked up
(one that fails to load, or takes a name already taken, is left out with one line on stderr):

    [project.entry-points."torchfleet.strategies"]
    ddp-tp = "my_package.presets:DDP_TP"

A preset of the mesh's degrees needs no code: the class that runs it follows
from its degrees (strategies/__init__.py's `class_for`). No torch here: the
launcher and `--help` read it before torch is imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata

from torchfleet.errors import UsageError

ENTRY_POINT_GROUP = "torchfleet.strategies"
DIM_NAMES = ("dp_replicate", "dp_shard", "pp", "tp")
# Expert parallelism borrows its processes from the data-parallel ones instead of multiplying them
# (torchtitan's ep): a preset may name it beside the four, None meaning every data-parallel rank.
BORROWED_DIMS = ("ep",)
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
# The classes that run the mesh's presets, by what the degrees hold: pipeline stages, else parameters split across
# processes (FSDP2's shards, tensor parallelism's pieces or experts: DTensors, whose state one class gathers and
# scatters), else whole replicas. "module:Class" under torchfleet.strategies, or a full dotted module.
MESH_CLASSES = {
    "stages": "torchfleet.strategies.pipeline.strategy:Pipeline",
    "split": "fsdp:SplitParameters",
    "replicas": "ddp:DataParallelDistributed",
}
# "auto": one process runs the reference, several the plain replicas (train/processes.py).
REFERENCE = "serial"
AUTO_SEVERAL = "ddp"


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
    (NCCL on a GPU box's one GPU); any other strategy alone has nothing to share and runs serial."""

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

    def __post_init__(self) -> None:
        if (self.degrees is None) == (self.runs is None):
            raise UsageError(f"strategy {self.name!r}: give its degrees or the class that runs it, one of the two")
        for what, value, choices in (("launch", self.launch, LAUNCHES), ("batchnorm", self.batchnorm, BATCHNORMS)):
            if value is not None and value not in choices:
                raise UsageError(f"strategy {self.name!r}: {what} {value!r} is not one of {', '.join(choices)}")
        if self.checks is not None and self.checks not in CHECKS:
            raise UsageError(f"strategy {self.name!r}: checks {self.checks!r} is not one of {', '.join(CHECKS)}")
        if self.degrees is not None:
            unknown = [d for d in self.degrees if d not in DIM_NAMES + BORROWED_DIMS]
            if unknown or [self.degrees[d] for d in self.degrees if d in DIM_NAMES].count(None) != 1:
                raise UsageError(
                    f"strategy {self.name!r}: degrees {dict(self.degrees)} must name only"
                    f" {', '.join(DIM_NAMES + BORROWED_DIMS)}, exactly one of the first four None"
                    " (the processes left over)"
                )

    @property
    def mesh(self) -> bool:
        return self.degrees is not None

    @property
    def shards(self) -> bool:
        """Its parameters are split (FSDP2's shards, tensor parallelism or experts), whatever the degrees come to."""
        degrees = self.degrees or {}
        return "dp_shard" in degrees or "tp" in degrees or "ep" in degrees

    @property
    def runs_class(self) -> str:
        """Where the class that runs it is ("module:Class"): its own, or for the mesh's degrees the one they need."""
        if self.degrees is None:
            return str(self.runs)
        return mesh_class(pipelined="pp" in self.degrees, split=self.shards)

    @property
    def min_processes(self) -> int:
        """The fewest processes that show every dimension it names: 2 each."""
        if self.degrees is None:
            return 1
        return 2 ** len([d for d in self.degrees if d in DIM_NAMES])


def mesh_class(pipelined: bool, split: bool) -> str:
    """The class that runs degrees with a pipeline (`pipelined`) or parameters split across processes (`split`)."""
    return MESH_CLASSES["stages" if pipelined else "split" if split else "replicas"]


_ONE = "one process"
BUILT_IN = (
    Preset(
        "serial",
        "one process on one device: the reference every other strategy is compared with",
        "nothing",
        runs="serial:Serial",
        launch=_ONE,
        cost="one",
        batchnorm="whole batch",
        checks="one device",
    ),
    Preset(
        "hogwild",
        "workers on one machine share the model's memory and update it without locks",
        "CPU; no checkpoints",
        runs="torchfleet.hogwild.worker:Hogwild",
        launch="spawn",
        cost="here",
        batchnorm="own batches",
        checks="worker cores",
    ),
    Preset(
        "dp",
        "`nn.DataParallel`: one process splits each batch across the visible GPUs",
        "2+ GPUs to pay",
        runs="dp:DataParallelSingleProcess",
        launch=_ONE,
        cost=None,
        batchnorm="chunks",
        checks="split batch",
    ),
    Preset(
        "mp",
        "one process, the model cut into stages on several devices, micro-batches flowing as a wavefront",
        "2+ devices to pay (`--devices`)",
        runs="mp:ModelParallel",
        launch=_ONE,
        cost="stages here",
        batchnorm="micro-batches",
        checks="placed stages",
        traced=True,
    ),
    Preset(
        "ddp",
        "DistributedDataParallel: whole replicas, gradients all-reduced",
        "2+ processes",
        {"dp_replicate": None},
        batchnorm="shares",
        group_of_one=True,
    ),
    Preset(
        "fsdp",
        "FSDP2: parameters, gradients and optimizer state sharded per block",
        "2+ processes",
        {"dp_shard": None},
        batchnorm="shares",
        traced=True,
        group_of_one=True,
    ),
    Preset(
        "hsdp",
        "FSDP2 on a 2-D mesh: shards within a group, replicas across groups (one per machine)",
        "4+ processes",
        {"dp_replicate": 2, "dp_shard": None},
        across_nodes="dp_replicate",
        batchnorm="shares",
        traced=True,
    ),
    Preset(
        "pipeline",
        "the model cut into stages, one (or more) per process, run by a `--schedule`",
        "one example batch for a non-`Sequential` model",
        {"pp": None},
        batchnorm="stage micro-batches",
        traced=True,
    ),
    Preset(
        "ddp+pipeline",
        "replicas of a pipeline",
        "4+ processes",
        {"dp_replicate": None, "pp": 2},
        batchnorm="stage micro-batches",
        traced=True,
    ),
    Preset(
        "fsdp+pipeline",
        "a pipeline whose stages are sharded",
        "4+ processes",
        {"dp_shard": None, "pp": 2},
        batchnorm="stage micro-batches",
        traced=True,
    ),
    Preset(
        "tp",
        "tensor parallelism: each layer of the model's plan split across processes",
        "a plan (the built-in `gpt` has one, so do Llama and most decoder families in transformers)",
        {"tp": None},
        traced=True,
    ),
    Preset(
        "fsdp+tp",
        "FSDP2 over tensor-parallel groups",
        "4+ processes and a plan",
        {"dp_shard": None, "tp": 2},
        traced=True,
    ),
    Preset(
        "ep",
        "expert parallelism: each mixture-of-experts layer's experts split over every process, tokens sent to"
        " theirs with all-to-all; the rest replicated",
        "a model with experts (transformers' MoE models, the built-in gpt-moe)",
        {"dp_replicate": None, "ep": None},
        traced=True,
    ),
    Preset(
        "fsdp+ep",
        "FSDP2 shards the model, and the experts are split over groups of `--ep` processes (default 2)",
        "2+ processes and a model with experts",
        {"dp_shard": None, "ep": 2},
        traced=True,
    ),
    Preset(
        "diloco",
        "replica groups train apart and meet every `--sync-every` steps with an outer Nesterov step",
        "torchft (`torchfleet[ft]`); for slow links",
        {"dp_replicate": None},
        launch="replica groups",
        cost="meetings",
    ),
    Preset(
        "localsgd",
        "replica groups average their weights every `--sync-every` steps",
        "torchft; for slow links",
        {"dp_replicate": None},
        launch="replica groups",
        cost="meetings",
    ),
)

_presets: dict[str, Preset] = {p.name: p for p in BUILT_IN}
_loaded = False


def register(preset: Preset, replace: bool = False) -> Preset:
    """Add `preset`; a name already taken is refused unless `replace`."""
    if preset.name in _presets and not replace and _presets[preset.name] != preset:
        raise UsageError(f"strategy {preset.name!r} is registered already; choose another name")
    if not preset.name or "/" in preset.name or preset.name == "auto":
        raise UsageError(f"strategy name {preset.name!r} is not usable: it must be a word other than auto, without '/'")
    _presets[preset.name] = preset
    return preset


def _left_out(entry: metadata.EntryPoint, why: str) -> None:
    """A plug-in that cannot be used costs its own presets only: one line (from the first rank), and on."""
    if os.environ.get("RANK", "0") == "0":
        print(
            f"torchfleet: the strategy entry point {entry.name} ({entry.value}) is left out: {why}",
            file=sys.stderr,
            flush=True,
        )


def _load_entry_points() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            found = entry.load()
        except Exception as exc:  # whatever a third party's import raises
            _left_out(entry, f"it failed to load ({type(exc).__name__}: {exc})")
            continue
        for preset in found if isinstance(found, (list, tuple)) else [found]:
            if not isinstance(preset, Preset):
                _left_out(entry, f"it gave {type(preset).__name__} {preset!r:.40}, not a torchfleet.strategies.Preset")
                continue
            try:
                register(preset)
            except UsageError as exc:
                _left_out(entry, str(exc))


def presets() -> dict[str, Preset]:
    """name -> Preset, built-in first, then those registered or found through entry points."""
    _load_entry_points()
    return _presets


def names() -> tuple[str, ...]:
    return tuple(presets())


def find(name: str) -> Preset | None:
    return presets().get(name)


def traced(name: str) -> bool:
    """plan traces `name`'s memory on fake tensors (plan/layout_trace.py); False for a name not registered."""
    preset = find(name)
    return preset is not None and preset.traced


def spans_devices(name: str) -> bool:
    """One process whose work spreads over every visible device (dp's split batch, mp's placed stages):
    its cell counts the devices, not its one process."""
    preset = find(name)
    return preset is not None and preset.checks in ("split batch", "placed stages")


def auto(processes: int) -> str:
    """The strategy "auto" means on `processes` processes (no GPU count known)."""
    return AUTO_SEVERAL if processes > 1 else REFERENCE


def markdown_table() -> str:
    """The README's table of strategies."""
    rows = ["| strategy | what it does | what it needs |", "| --- | --- | --- |"]
    rows += [f"| `{p.name}` | {p.summary} | {p.needs} |" for p in presets().values()]
    return "\n".join(rows)


def options_for(name: str, given: Mapping[str, object] | None) -> dict:
    """The strategy options `name` runs with: its preset's defaults under those given."""
    preset = find(name)
    return {**(preset.defaults if preset is not None else {}), **(given or {})}
