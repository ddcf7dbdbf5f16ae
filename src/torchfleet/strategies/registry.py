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
from collections.abc import Collection, Mapping
from importlib import metadata

from torchfleet.errors import UsageError
from torchfleet.strategies.preset import (
    BATCHNORMS,
    BORROWED_DIMS,
    CHECKS,
    DIM,
    DIM_NAMES,
    DIMS,
    DP_REPLICATE,
    DP_SHARD,
    EP,
    LAUNCHES,
    MEETINGS,
    MESH_CLASSES,
    PP,
    TP,
    Preset,
    class_path,
    mesh_class,
)

ENTRY_POINT_GROUP = "torchfleet.strategies"
# "auto": one process runs the reference, several the plain replicas (train/processes.py).
REFERENCE = "serial"
AUTO_SEVERAL = "ddp"

# The declaration's words (strategies/preset.py) are read through this module as well.
__all__ = [
    "AUTO_SEVERAL",
    "BATCHNORMS",
    "BORROWED_DIMS",
    "CHECKS",
    "DIM",
    "DIM_NAMES",
    "DIMS",
    "DP_REPLICATE",
    "DP_SHARD",
    "EP",
    "ENTRY_POINT_GROUP",
    "LAUNCHES",
    "MEETINGS",
    "MESH_CLASSES",
    "PP",
    "REFERENCE",
    "TP",
    "Preset",
    "BUILT_IN",
    "auto",
    "class_path",
    "find",
    "markdown_table",
    "mesh_class",
    "name_of_class",
    "name_of_degrees",
    "names",
    "options_for",
    "presets",
    "register",
    "shares_gpus",
    "spans_devices",
    "traced",
]

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
        meets="pseudo-gradients",
    ),
    Preset(
        "localsgd",
        "replica groups average their weights every `--sync-every` steps",
        "torchft; for slow links",
        {"dp_replicate": None},
        launch="replica groups",
        cost="meetings",
        meets="weights",
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


def shares_gpus(name: str) -> bool:
    """Whether `name`'s processes may share GPUs, their collectives over Gloo (Preset.shares_gpus)."""
    preset = find(name)
    return preset is not None and preset.shares_gpus


def name_of_class(where: str) -> str | None:
    """The name of the first preset that the class at `where` ("package.module:Class") runs, None for a class no
    preset runs: what the class is called where no degrees name it (ddp's one process under torchrun, an error
    before its degrees are known). The first is the plainest, as the built-in presets are declared simplest
    first: DataParallelDistributed is ddp, not diloco. Asked as the class is defined, so of the presets
    registered so far: loading the entry points here could import a plug-in that imports that very class."""
    return next((p.name for p in _presets.values() if class_path(p.runs_class) == where), None)


def _naming_exactly(dims: set[str]) -> str | None:
    """The first preset that names exactly `dims`: a built-in one, else one registered since."""
    for preset in (*BUILT_IN, *_presets.values()):
        if preset.degrees is not None and set(preset.degrees) == dims:
            return preset.name
    return None


def name_of_degrees(dims: Collection[str]) -> str:
    """The name of a run whose degrees above 1 are those of `dims` (dimension names; degrees that can run
    together): the first preset that names exactly them (built-in first), else that of their data-parallel part (expert
    parallelism among it) and that of the part that cuts the model (pp or tp) joined by "+" ("hsdp+pipeline",
    "ep+tp"), else the dimensions themselves ("dp_replicate+cp"). With none above 1 it is one replica: ddp.
    Built-in presets first, so a plug-in's preset of the same degrees runs under the built-in name, as the
    checkpoints and reports of those degrees always have; a registered one names only degrees no built-in does."""
    wanted = set(dims) or {DP_REPLICATE}
    whole = _naming_exactly(wanted)
    if whole is not None:
        return whole
    model = wanted & {PP, TP}
    parts = [_naming_exactly(wanted - model), _naming_exactly(model)]
    if None in parts:  # degrees no preset names, in part: their dimensions, in the mesh's order
        return "+".join(n for n in (*DIM_NAMES, *BORROWED_DIMS) if n in wanted)
    return "+".join(str(part) for part in parts)


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
