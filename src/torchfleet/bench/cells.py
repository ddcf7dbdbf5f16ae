"""The matrix's cells: which strategies, process counts, batches and precisions run here, and why others do not.

Within each (batch, precision) serial comes first, as the baseline of every speedup; a
single-process strategy is one cell, a multi-process one a cell per process count of
`--nproc` that shows its degrees. launch_cell.py runs each cell, matrix.py the whole matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchfleet.bench.config import BenchConfig
from torchfleet.errors import UsageError
from torchfleet.models import EXPERT_MODELS, TOKEN_MODELS
from torchfleet.replica_groups import sync_methods
from torchfleet.strategies import STRATEGIES, registry, resolve_dims
from torchfleet.strategies.pipeline.schedules import schedule_variant
from torchfleet.strategies.registry import EP, TP


@dataclass(frozen=True)
class Cell:
    strategy: str
    processes: int
    global_batch: int
    precision: str
    threads: int  # intra-op threads per process
    skip: str | None = None  # why the cell is not run, when it is not


def _default_batches(model: str, gpus: int) -> tuple[int, ...]:
    if model in TOKEN_MODELS:
        # gpt2's 1,024-token sequences: batch 32 in fp32 takes about half of an 80 GB GPU.
        return (8, 32) if gpus else (16, 64)
    if gpus:
        return (128, 512)  # the notebook's ResNet-50 batches
    return (16, 64) if model.startswith("resnet") else (64, 512)


def _default_precisions(gpus: int) -> tuple[str, ...]:
    if not gpus:
        return ("fp32",)  # bf16 runs on CPU too (ask for it), but rarely faster there
    import torch

    return ("fp32", "bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp32", "fp16")


def resolve(cfg: BenchConfig, gpus: int) -> BenchConfig:
    """`cfg` with every "choose for this machine" default filled in."""
    nproc = cfg.nproc or (tuple(sorted({2, gpus})) if gpus >= 2 else (2,))
    return replace(
        cfg,
        nproc=nproc,
        gpt_preset=cfg.gpt_preset or ("gpt2" if gpus else "tiny"),
        batch_sizes=cfg.batch_sizes or _default_batches(cfg.model, gpus),
        precisions=cfg.precisions or _default_precisions(gpus),
    )


def plan(cfg: BenchConfig, availability: list[dict], cores: int, hogwild: bool = False) -> tuple[list[Cell], list[str]]:
    """The cells to run, in order, and notes about what was chosen and why.

    Within each (batch, precision) serial runs first, so a speedup is known as
    soon as its cell ends. `hogwild`: whether the strategies that spawn their own
    workers (hogwild) are among those chosen for this machine (the planner's
    candidates, which model its workers).
    """
    here = {a["name"]: a for a in availability}
    notes = []
    if cfg.strategies:
        chosen = list(dict.fromkeys(cfg.strategies))
    else:
        chosen = [name for name in STRATEGIES if here.get(name, {}).get("available")]
    # diloco and localsgd are replica groups meeting every few steps, to spare a slow link between machines:
    # on one machine there is no such link (and Fleet refuses them alone), so link mode measures them.
    meeting = [name for name in chosen if name in sync_methods.methods()]
    if meeting:
        chosen = [name for name in chosen if name not in meeting]
        they, pays, them = ("they", "pay", "them") if len(meeting) > 1 else ("it", "pays", "it")
        notes.append(
            f"{' and '.join(meeting)} left out: {they} {pays} only over a slow link between machines,"
            f" where ddp spends most of each step exchanging gradients; measure {them} against ddp there"
            " with link mode, the same command on every machine: torchfleet bench --nnodes 2"
            " --node-rank R --master-addr NODE0_ADDRESS"
        )
    if not cfg.strategies:
        if cfg.model not in TOKEN_MODELS:  # tensor parallelism needs a plan: the built-in gpt has one
            chosen = _left_out(
                chosen,
                TP,
                notes,
                f"{cfg.model} has no tensor-parallel plan (ask for them with --strategies on a model with one)",
            )
        # Expert parallelism needs experts: of the built-in models only gpt-moe has them (a model of the user's
        # own, MODULE:FUNCTION, is not built yet here; its cells refuse it in one sentence if it has none).
        if ":" not in cfg.model and cfg.model not in EXPERT_MODELS:
            chosen = _left_out(
                chosen,
                EP,
                notes,
                f"{cfg.model} has no experts to split (ask for them with"
                " --strategies on a model with experts, such as --model gpt-moe)",
            )
        # A cell times Fleet.train_step in the cell's own processes, where a strategy that spawns its own workers
        # (hogwild) has one worker and steps as serial does (hogwild/worker.py): its row would carry a name it did
        # not run, and tie with serial's.
        spawned = [] if hogwild else [name for name in chosen if registry.presets()[name].launch == "spawn"]
        for name in spawned:
            chosen.remove(name)
            notes.append(
                f"{name} left out: in a bench cell it has one worker and steps as serial does (ask for it with"
                f" --strategies; torchfleet train --strategy {name} runs its workers)"
            )
        left_out = [
            f"{name} ({here[name]['why']})" for name in STRATEGIES if name in here and not here[name]["available"]
        ]
        if left_out:
            notes.append("not available here: " + "; ".join(left_out))
    if registry.REFERENCE not in chosen:
        notes.append(f"{registry.REFERENCE} added: it is the baseline every speedup is measured against")
    chosen = [registry.REFERENCE] + [name for name in chosen if name != registry.REFERENCE]

    cells = []
    for batch in cfg.batch_sizes:
        for precision in cfg.precisions:
            for name in chosen:
                cells.extend(_cells_of(name, batch, precision, cfg, here, cores, notes))
    return cells, list(dict.fromkeys(notes))


def variant(name: str) -> tuple[str, dict]:
    """(strategy, options) of a cell's name: "pipeline/interleaved-1f1b" is the pipeline under that
    schedule (opt-in: asked for by name with --strategies, never in the default matrix)."""
    return schedule_variant(name) if "/" in name else (name, {})


def _cells_of(name, batch, precision, cfg, here, cores, notes) -> list[Cell]:
    base = variant(name)[0]
    cls = STRATEGIES[base]
    if not cls.distributed:
        counts = [1]
    else:
        counts = [n for n in cfg.nproc if n >= 2]
        if not counts:
            notes.append(f"{name} needs 2 or more processes; --nproc {cfg.nproc} gives none")
        # A preset of two dimensions on too few processes degenerates (hsdp on 2 is
        # ddp): such a cell would carry a name it did not run, so it is left out.
        fits = [n for n in counts if _shows_its_degrees(base, n, cfg.strategy_options)]
        if counts and len(fits) < len(counts):
            notes.append(
                f"{name} left out on {', '.join(str(n) for n in counts if n not in fits)} processes:"
                f" its degrees need more (e.g. --nproc 4 for 2 x 2)"
            )
        counts = fits
    threads = {n: cfg.threads or max(1, cores // n) for n in counts}
    info = here.get(base)
    skip = None
    if info is not None and not info["available"]:
        skip = f"not available here: {info['why']}"
    return [Cell(name, n, batch, precision, threads[n], skip) for n in counts]


def _left_out(chosen: list[str], degree: str, notes: list[str], why: str) -> list[str]:
    """`chosen` without the presets that name `degree`, with a note saying which and `why`."""
    dropped = [name for name in chosen if degree in preset_degrees(name)]
    if dropped:
        notes.append(f"{', '.join(dropped)} left out: {why}")
    return [name for name in chosen if name not in dropped]


def preset_degrees(name: str) -> dict:
    """The degrees the preset `name` names ({} for a strategy that is a class of its own)."""
    preset = registry.find(name)
    return dict(preset.degrees or {}) if preset is not None else {}


def _shows_its_degrees(name: str, processes: int, options: dict) -> bool:
    """Whether `name` on `processes` has every dimension its preset names above 1 (hsdp on 2 is ddp)."""
    given = {k: v for k, v in options.items() if k in preset_degrees(name)}
    try:
        dims = resolve_dims(name, processes, options=given)
    except UsageError:
        return False
    return dims is None or all(getattr(dims, d) > 1 for d in preset_degrees(name))
