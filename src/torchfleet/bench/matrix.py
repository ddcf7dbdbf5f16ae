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
and the rest of the matrix still runs. cells.py chooses the cells, launch_cell.py
runs one, rounds.py runs them all in interleaved rounds; here the whole command
measures how busy the machine is first (machine_load.py), runs the rounds, derives
the figures below and flags those that cannot hold (verdict.py).

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
from dataclasses import asdict, replace

from torchfleet import machine_load
from torchfleet.bench import rounds
from torchfleet.bench.cells import plan, resolve
from torchfleet.bench.config import BenchConfig
from torchfleet.bench.flops import peak_flops
from torchfleet.bench.verdict import flag
from torchfleet.doctor import strategy_availability
from torchfleet.errors import UsageError
from torchfleet.strategies import registry

# A smoke test in under a minute on 2 CPU cores (5 rounds a cell, each of at least 6 timed steps and as many
# as take round_time_s, so that one slow process among them is an outlier: rounds.TRIMMED_FROM), whichever
# model is asked for.
QUICK = {
    "model": "mlp",
    "batch_sizes": (64,),
    "nproc": (2,),
    "precisions": ("fp32",),
    "warmup": 2,
    "steps": 6,
    "rounds": 5,
    "gpt_preset": "tiny",
    "image_size": 32,
}


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---- derived figures ---------------------------------------------------------------------


def derive(rows: list[dict], gpus: int = 0) -> None:
    """Fill the derived figures of the module doc in place (None where not measurable).

    `gpus`: the GPUs here, which dp and mp (one process) spread their work over.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    serial = {
        (r["global_batch"], r["precision"]): r["step_time_median_s"] for r in ok if r["strategy"] == registry.REFERENCE
    }
    fp32 = {
        (r["strategy"], r["processes"], r["global_batch"]): r["step_time_median_s"]
        for r in ok
        if r["precision"] == "fp32"
    }
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
            devices = max(1, gpus) if registry.spans_devices(r["strategy"]) else r["processes"]
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
    # First, so that a busy start is the first thing said, with its figure.
    state = machine_load.measure(gpus=hw.gpus)
    console.print(("warning: " if state.busy else "") + state.line(), markup=False)
    console.print(f"measuring {rounds.sizing(asdict(cfg))}", markup=False)
    for note in notes:
        console.print(f"note: {note}", markup=False)  # brackets in a note are text, not styles

    with bench_report.progress(console, rounds.runs(cells, cfg)) as bar:
        rows = rounds.run(cells, cfg, bar)
        derive(rows, hw.gpus)
        flag(rows, cores, hw.gpus)
        for row in rows:
            bar.done(row)
    document = bench_report.document(cfg, machine, rows, notes, state.row())
    bench_report.write_json(document, out / "results.json")
    bench_report.write_csv(rows, out / "results.csv")
    console.print(bench_report.table(document))
    chart = bench_chart.draw(rows, out / "bench.png", title=bench_report.chart_title(document))
    console.print(f"verdict: {document['verdict']}", markup=False)
    console.print(
        f"wrote {out / 'results.json'}, {out / 'results.csv'}"
        + (f", {chart}" if chart.endswith(".png") else f" ({chart})"),
        markup=False,
    )
    return document
