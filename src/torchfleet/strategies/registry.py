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


@dataclass(frozen=True)
class Preset:
    """One strategy. `degrees` (mesh presets): the degree each dimension takes, None for "the processes
    left over" (exactly one). `runs`: "module:Class" under torchfleet.strategies, or a full dotted module
    ("torchfleet.hogwild.worker:Hogwild"), for a strategy that is a class of its own rather than degrees.
    `defaults`: strategy options it sets unless a flag does.
    `across_nodes`: the degree that takes the number of machines when there are several (hsdp's
    replicas). `cost`: how plan predicts it: "mesh" (from the degrees), "meetings" (replica groups meeting
    every few steps), "one" (one process), "mp" (one process, micro-batches through stages on its devices;
    planned on this machine only), "here" (one process, planned on this machine only), or None (not planned)."""

    name: str
    summary: str
    needs: str
    degrees: Mapping[str, int | None] | None = None
    runs: str | None = None
    defaults: Mapping[str, object] = field(default_factory=dict)
    launch: str = "agent"
    across_nodes: str | None = None
    cost: str | None = "mesh"

    def __post_init__(self) -> None:
        if (self.degrees is None) == (self.runs is None):
            raise UsageError(f"strategy {self.name!r}: give its degrees or the class that runs it, one of the two")
        if self.launch not in LAUNCHES:
            raise UsageError(f"strategy {self.name!r}: launch {self.launch!r} is not one of {', '.join(LAUNCHES)}")
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
    def min_processes(self) -> int:
        """The fewest processes that show every dimension it names: 2 each."""
        if self.degrees is None:
            return 1
        return 2 ** len([d for d in self.degrees if d in DIM_NAMES])


_ONE = "one process"
BUILT_IN = (
    Preset(
        "serial",
        "one process on one device: the reference every other strategy is compared with",
        "nothing",
        runs="serial:Serial",
        launch=_ONE,
        cost="one",
    ),
    Preset(
        "hogwild",
        "workers on one machine share the model's memory and update it without locks",
        "CPU; no checkpoints",
        runs="torchfleet.hogwild.worker:Hogwild",
        launch="spawn",
        cost="here",
    ),
    Preset(
        "dp",
        "`nn.DataParallel`: one process splits each batch across the visible GPUs",
        "2+ GPUs to pay",
        runs="dp:DataParallelSingleProcess",
        launch=_ONE,
        cost=None,
    ),
    Preset(
        "mp",
        "one process, the model cut into stages on several devices, micro-batches flowing as a wavefront",
        "2+ devices to pay (`--devices`)",
        runs="mp:ModelParallel",
        launch=_ONE,
        cost="mp",
    ),
    Preset(
        "ddp", "DistributedDataParallel: whole replicas, gradients all-reduced", "2+ processes", {"dp_replicate": None}
    ),
    Preset(
        "fsdp", "FSDP2: parameters, gradients and optimizer state sharded per block", "2+ processes", {"dp_shard": None}
    ),
    Preset(
        "hsdp",
        "FSDP2 on a 2-D mesh: shards within a group, replicas across groups (one per machine)",
        "4+ processes",
        {"dp_replicate": 2, "dp_shard": None},
        across_nodes="dp_replicate",
    ),
    Preset(
        "pipeline",
        "the model cut into stages, one (or more) per process, run by a `--schedule`",
        "one example batch for a non-`Sequential` model",
        {"pp": None},
    ),
    Preset("ddp+pipeline", "replicas of a pipeline", "4+ processes", {"dp_replicate": None, "pp": 2}),
    Preset("fsdp+pipeline", "a pipeline whose stages are sharded", "4+ processes", {"dp_shard": None, "pp": 2}),
    Preset(
        "tp",
        "tensor parallelism: each layer of the model's plan split across processes",
        "a plan (the built-in `gpt` has one, so do Llama and most decoder families in transformers)",
        {"tp": None},
    ),
    Preset("fsdp+tp", "FSDP2 over tensor-parallel groups", "4+ processes and a plan", {"dp_shard": None, "tp": 2}),
    Preset(
        "ep",
        "expert parallelism: each mixture-of-experts layer's experts split over every process, tokens sent to"
        " theirs with all-to-all; the rest replicated",
        "a model with experts (transformers' MoE models, the built-in gpt-moe)",
        {"dp_replicate": None, "ep": None},
    ),
    Preset(
        "fsdp+ep",
        "FSDP2 shards the model, and the experts are split over groups of `--ep` processes (default 2)",
        "2+ processes and a model with experts",
        {"dp_shard": None, "ep": 2},
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


def markdown_table() -> str:
    """The README's table of strategies."""
    rows = ["| strategy | what it does | what it needs |", "| --- | --- | --- |"]
    rows += [f"| `{p.name}` | {p.summary} | {p.needs} |" for p in presets().values()]
    return "\n".join(rows)


def options_for(name: str, given: Mapping[str, object] | None) -> dict:
    """The strategy options `name` runs with: its preset's defaults under those given."""
    preset = find(name)
    return {**(preset.defaults if preset is not None else {}), **(given or {})}
