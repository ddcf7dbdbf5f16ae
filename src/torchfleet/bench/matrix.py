"""`torchfleet bench`: the strategies side by side on this machine, one fresh process group per cell.

The matrix is strategy x processes x global batch x precision. Strategies are
every one in the registry (strategies/__init__.py) that `doctor` reports as
available here, so a strategy appears in the benchmark the moment it is
registered (the pipeline's other schedules are cells of their own, asked for
by name: `--strategies pipeline,pipeline/interleaved-1f1b,pipeline/zbv`, 2
stages per process where the schedule takes several); `serial` is always measured, as the baseline of every speedup.
A single-process strategy (`distributed = False`) is measured in one process;
a multi-process one at each process count of `--nproc` (2 and more). Every
cell runs in new processes started through `torchfleet.launcher.launch`
(measure_cell.run_cell is what they run), so a cell that fails (a bad batch, an
out-of-memory, a crash, a hang past the timeout) is one row with its reason
and the rest of the matrix still runs.

Derived figures, for each cell that ran:
  samples_per_s = global_batch / median step time
  speedup       = serial's median step time / this cell's, at the same global batch and precision
  efficiency    = speedup / processes
  tokens_per_s  = samples_per_s * the preset's block size (gpt: a sample is a sequence)
  vs_fp32       = the same cell's median step time at fp32 / this cell's (mixed precision's gain)
  model_tflops  = model FLOPs per sample (flops.py) * samples_per_s / 1e12
  mfu           = model FLOP/s / (one GPU's dense peak at this precision * processes), on known GPUs
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from torchfleet.bench import measure_cell as bench_cell
from torchfleet.bench.config import BenchConfig
from torchfleet.bench.flops import peak_flops
from torchfleet.doctor import strategy_availability
from torchfleet.errors import UsageError
from torchfleet.launcher.agent import LaunchError, launch
from torchfleet.models import TOKEN_MODELS, gpt_config
from torchfleet.replica_groups.sync_methods import METHODS as MEETING_METHODS
from torchfleet.strategies import STRATEGIES, registry, resolve_dims
from torchfleet.strategies.dims import DIM_NAMES
from torchfleet.strategies.pipeline.schedules import schedule_variant

# A smoke test in seconds on 2 CPU cores, whichever model is asked for.
QUICK = {"model": "mlp", "batch_sizes": (64,), "nproc": (2,), "precisions": ("fp32",),
         "warmup": 2, "steps": 6, "gpt_preset": "tiny", "image_size": 32}


@dataclass(frozen=True)
class Cell:
    strategy: str
    processes: int
    global_batch: int
    precision: str
    threads: int  # intra-op threads per process
    skip: str | None = None  # why the cell is not run, when it is not


# ---- the plan ----------------------------------------------------------------------------


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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
    return replace(cfg, nproc=nproc, gpt_preset=cfg.gpt_preset or ("gpt2" if gpus else "tiny"),
                   batch_sizes=cfg.batch_sizes or _default_batches(cfg.model, gpus),
                   precisions=cfg.precisions or _default_precisions(gpus))


def plan(cfg: BenchConfig, availability: list[dict], cores: int) -> tuple[list[Cell], list[str]]:
    """The cells to run, in order, and notes about what was chosen and why.

    Within each (batch, precision) serial runs first, so a speedup is known as
    soon as its cell ends.
    """
    here = {a["name"]: a for a in availability}
    notes = []
    if cfg.strategies:
        chosen = list(dict.fromkeys(cfg.strategies))
    else:
        chosen = [name for name in STRATEGIES if here.get(name, {}).get("available")]
    # diloco and localsgd are replica groups meeting every few steps, to spare a slow link between machines:
    # on one machine there is no such link (and Fleet refuses them alone), so link mode measures them.
    meeting = [name for name in chosen if name in MEETING_METHODS]
    if meeting:
        chosen = [name for name in chosen if name not in MEETING_METHODS]
        they, pays, them = ("they", "pay", "them") if len(meeting) > 1 else ("it", "pays", "it")
        notes.append(f"{' and '.join(meeting)} left out: {they} {pays} only over a slow link between machines,"
                     f" where ddp spends most of each step exchanging gradients; measure {them} against ddp there"
                     " with link mode, the same command on every machine: torchfleet bench --nnodes 2"
                     " --node-rank R --master-addr NODE0_ADDRESS")
    if not cfg.strategies:
        if cfg.model not in TOKEN_MODELS:  # tensor parallelism needs a plan: the built-in gpt has one
            planless = [name for name in chosen if "tp" in _degrees(name)]
            chosen = [name for name in chosen if name not in planless]
            if planless:
                notes.append(f"{', '.join(planless)} left out: {cfg.model} has no tensor-parallel plan"
                             " (ask for them with --strategies on a model with one)")
        left_out = [f"{name} ({here[name]['why']})" for name in STRATEGIES
                    if name in here and not here[name]["available"]]
        if left_out:
            notes.append("not available here: " + "; ".join(left_out))
    if "serial" not in chosen:
        notes.append("serial added: it is the baseline every speedup is measured against")
    chosen = ["serial"] + [name for name in chosen if name != "serial"]

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
            notes.append(f"{name} left out on {', '.join(str(n) for n in counts if n not in fits)} processes:"
                         f" its degrees need more (e.g. --nproc 4 for 2 x 2)")
        counts = fits
    threads = {n: cfg.threads or max(1, cores // n) for n in counts}
    info = here.get(base)
    skip = None
    if info is not None and not info["available"]:
        skip = f"not available here: {info['why']}"
    return [Cell(name, n, batch, precision, threads[n], skip) for n in counts]


def _degrees(name: str) -> dict:
    """The degrees the preset `name` names ({} for a strategy that is a class of its own)."""
    preset = registry.find(name)
    return dict(preset.degrees or {}) if preset is not None else {}


def _shows_its_degrees(name: str, processes: int, options: dict) -> bool:
    """Whether `name` on `processes` has every dimension its preset names above 1 (hsdp on 2 is ddp)."""
    given = {k: v for k, v in options.items() if k in _degrees(name)}
    try:
        dims = resolve_dims(name, processes, options=given)
    except UsageError:
        return False
    return dims is None or all(getattr(dims, d) > 1 for d in _degrees(name))


# ---- running one cell --------------------------------------------------------------------


def _worker_processes() -> list[int]:
    """The cell's worker processes: children of this process started by multiprocessing's spawn, or children
    of the forkserver this process started, which `launch` forks its workers from (launcher/forked.py)."""
    from torchfleet.launcher import forked

    server = forked.server_pid()
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if (ppid == me and b"spawn_main" in cmdline) or (server is not None and ppid == server):
            found.append(int(entry.name))
    return found


class _Deadline:
    """Kill the cell's workers when it runs past `seconds`; the launcher then reports them failed.

    After the deadline it keeps killing once a second, so workers that were
    still being started at that moment do not escape.
    """

    def __init__(self, seconds: float):
        self.seconds, self.expired = seconds, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if self._stop.wait(self.seconds):
            return
        self.expired = True
        while not self._stop.is_set():
            for pid in _worker_processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._stop.wait(1.0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def failure_reason(summary) -> str:
    """One line saying why a cell failed, from the launcher's failure summary."""
    first = summary.first
    if first.usage_error:
        text = first.error.split(": ", 1)[-1]
    elif first.error:
        text = f"rank {first.rank}: {first.error}"
    else:
        text = f"rank {first.rank} {first.how}"
        if first.how == "killed by SIGKILL":
            text += " (the kernel's OOM killer does this when memory runs out)"
    text = text.strip().splitlines()[0] if text.strip() else "no reason recorded"
    return text if len(text) <= 300 else text[:297] + "..."


def run_one(cell: Cell, cfg: BenchConfig) -> dict:
    """Measure `cell` in its own processes; always returns a row, never raises for the cell's failure."""
    row = {"model": cfg.model, **asdict(cell), "compile": cfg.compile or "off", "warmup": cfg.warmup,
           "steps": cfg.steps}
    row.pop("threads")
    row["threads_per_process"] = cell.threads
    row.pop("skip")
    if cell.skip:
        return {**row, "status": "skipped", "error": cell.skip}
    base, extra = variant(cell.strategy)
    cls = STRATEGIES[base]
    preset = cfg.gpt_preset or "tiny"  # resolve() has chosen; an unresolved config gets the CPU's choice
    if cfg.model in TOKEN_MODELS:
        row["tokens_per_sample"] = gpt_config(preset).block_size
    spec = {"model": cfg.model, "gpt_preset": preset, "image_size": cfg.image_size,
            "strategy": base, "processes": cell.processes,
            "global_batch": cell.global_batch, "precision": cell.precision,
            "threads": cell.threads, "warmup": cfg.warmup, "steps": cfg.steps, "seed": cfg.seed,
            "compile": cfg.compile,
            # each strategy gets only the options it takes: --microbatches is for mp and pipeline,
            # and a degree flag only for the presets that have that dimension (--pp not for ddp)
            "options": {**{k: v for k, v in cfg.strategy_options.items()
                           if k in cls.options and (k not in DIM_NAMES or k in _degrees(base))}, **extra}}
    start = time.perf_counter()
    try:
        with _Deadline(cfg.cell_timeout_s) as deadline:
            figures = launch(bench_cell.run_cell, nprocs=cell.processes, args=(spec,))[0]
    except LaunchError as exc:
        reason = (f"timed out after {cfg.cell_timeout_s:g} s" if deadline.expired
                  else failure_reason(exc.summary))
        return {**row, "status": "failed", "error": reason, "wall_s": time.perf_counter() - start}
    return {**row, **figures, "status": "ok", "error": None, "wall_s": time.perf_counter() - start}


# ---- derived figures ---------------------------------------------------------------------


def derive(rows: list[dict], gpus: int = 0) -> None:
    """Fill the derived figures of the module doc in place (None where not measurable).

    `gpus`: the GPUs here, which dp and mp (one process) spread their work over.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    serial = {(r["global_batch"], r["precision"]): r["step_time_median_s"] for r in ok if r["strategy"] == "serial"}
    fp32 = {(r["strategy"], r["processes"], r["global_batch"]): r["step_time_median_s"]
            for r in ok if r["precision"] == "fp32"}
    for r in rows:
        for field in ("samples_per_s", "tokens_per_s", "speedup", "efficiency", "vs_fp32", "model_tflops", "mfu"):
            r[field] = None
        if r["status"] != "ok":
            continue
        r["samples_per_s"] = r["global_batch"] / r["step_time_median_s"]
        if r.get("tokens_per_sample"):
            r["tokens_per_s"] = r["samples_per_s"] * r["tokens_per_sample"]
        base = serial.get((r["global_batch"], r["precision"]))
        if base is not None:
            r["speedup"] = base / r["step_time_median_s"]
            r["efficiency"] = r["speedup"] / r["processes"]
        full = fp32.get((r["strategy"], r["processes"], r["global_batch"]))
        if full is not None and r["precision"] != "fp32":
            r["vs_fp32"] = full / r["step_time_median_s"]
        if r.get("flops_per_sample"):
            achieved = r["flops_per_sample"] * r["samples_per_s"]
            r["model_tflops"] = achieved / 1e12
            peak = peak_flops(r.get("device_name"), r["precision"])
            devices = max(1, gpus) if r["strategy"] in ("dp", "mp") else r["processes"]
            if peak:
                r["mfu"] = achieved / (peak * devices)


# ---- the whole command -------------------------------------------------------------------


def run_bench(cfg: BenchConfig, console=None) -> dict:
    """Run the matrix, show it, write DIR/results.json, results.csv and bench.png; return the document."""
    from rich.console import Console

    from torchfleet.backend import probe_hardware
    from torchfleet.bench import chart as bench_chart
    from torchfleet.bench import report as bench_report
    from torchfleet.doctor import collect_report
    from torchfleet.outputs import check_writable_dir

    # Logs and pipes get a width that fits the table; a terminal keeps its own.
    console = console or Console(width=None if Console().is_terminal else 132)
    # torch's spawn helper logs each worker the agent stops after a failed cell; the row says why.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    out = check_writable_dir(cfg.out, what="--out")
    hw = probe_hardware()
    machine = collect_report(hw)
    cores = _usable_cores()
    cfg = resolve(cfg, hw.gpus)
    cells, notes = plan(cfg, strategy_availability(hw, cores), cores)
    if not cells:
        raise UsageError("nothing to benchmark: no strategy and process count fit together here")
    cfg = replace(cfg, strategies=tuple(dict.fromkeys(c.strategy for c in cells)))
    for note in notes:
        console.print(f"note: {note}", markup=False)  # brackets in a note are text, not styles

    rows: list[dict] = []
    with bench_report.progress(console, len(cells)) as bar:
        for cell in cells:
            bar.start(cell)
            rows.append(run_one(cell, cfg))
            derive(rows, hw.gpus)
            bar.done(rows[-1])
    document = bench_report.document(cfg, machine, rows, notes)
    bench_report.write_json(document, out / "results.json")
    bench_report.write_csv(rows, out / "results.csv")
    console.print(bench_report.table(document))
    chart = bench_chart.draw(rows, out / "bench.png", title=bench_report.chart_title(document))
    console.print(f"verdict: {document['verdict']}", markup=False)
    console.print(f"wrote {out / 'results.json'}, {out / 'results.csv'}" +
                  (f", {chart}" if chart.endswith(".png") else f" ({chart})"), markup=False)
    return document
