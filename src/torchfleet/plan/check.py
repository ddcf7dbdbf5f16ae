"""`torchfleet plan --check`: the plan's predictions against bench's measurements, cell by cell.

The cells are bench's (bench/cells.py chooses them: the strategies available
here, at each process count), each run in fresh processes through the
launcher as bench runs them, with bench's model, batch and optimizer (SGD with
momentum) and bench's timing (bench/measure_cell.py: warm-up, then steps that start
from a barrier and last as long as the slowest rank). Memory is the peak
tensor bytes of each rank over two more steps (tensor_memory.TensorMemory, a
GPU's max_memory_allocated on any device), measured after the timed steps so
its bookkeeping never slows them; a pipeline's too, each rank its own stage's
(tensor_memory.TensorMemory follows a stage run once per micro-batch).

Accuracy is |predicted / measured - 1| per cell; the summary gives the median
over the cells and the worst cell, for step time (bench's figure, the median
step) and for peak memory; and for the cell's fastest step, the figure the
calibration aims at (it takes the fastest of its own steps: on a machine
shared with others' jobs their load only ever adds to a step, so the median
of a few steps says as much about the neighbours as about the strategy).

Each cell is flagged as bench flags its cells (bench/verdict.py): a speedup over the
serial cell above what its processes on these cores allow, a spread of its steps
(IQR over median) above the limit, other processes' load while it ran
(machine_load.py). Flagged cells stay in the summary, which says how many were.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

MEMORY_STEPS = 2


def run_check_cell(spec: dict) -> dict | None:
    """In each of the cell's processes: bench's step timing, then the tensor peak; the main rank returns both."""
    import torch
    import torch.distributed as dist

    from torchfleet import machine_load
    from torchfleet.bench import measure_cell as bench_cell
    from torchfleet.data import check_global_batch
    from torchfleet.fleet import Fleet

    span = machine_load.Span()  # every rank's CPU seconds; the main rank's CPUs' busy seconds
    torch.set_num_threads(spec["threads"])
    fleet = Fleet(strategy=spec["strategy"], precision="fp32", **spec["options"])
    rank, readers = fleet.strategy.data_coords()
    check_global_batch(spec["global_batch"], readers)
    model, inputs, targets, loss_fn = bench_cell.workload(spec, spec["global_batch"] // readers, rank, fleet)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # bench's optimizer
    model, optimizer = fleet.setup(model, optimizer, example_inputs=inputs)

    def step():
        fleet.train_step(inputs, targets, loss_fn)

    for _ in range(spec["warmup"]):
        step()
    times = [bench_cell._timed(step, fleet.device) for _ in range(spec["steps"])]
    span.end()
    peak, why = _tensor_peak(model, optimizer, step, fleet.device)
    found: list[Any] = [None] * fleet.world_size
    if dist.is_initialized():
        dist.all_gather_object(found, (times, peak, span.own_cpu_s))
    else:
        found = [(times, peak, span.own_cpu_s)]
    result = None
    if fleet.is_main:
        step_times = [max(t[i] for t, _, _ in found) for i in range(len(times))]
        peaks = [p for _, p, _ in found]
        figures = bench_cell.spread(step_times)
        result = {
            **figures,
            "spread": (figures["step_time_q3_s"] - figures["step_time_q1_s"]) / figures["step_time_median_s"],
            "others_cores": span.others_cores(sum(cpu for *_, cpu in found)),
            "peak_tensor_bytes": peaks if None not in peaks else None,
            "memory_note": why,
            "microbatches": getattr(fleet.strategy, "microbatches", None),
        }
    fleet.close()
    return result


def _tensor_peak(model, optimizer, step, device) -> tuple[int | None, str | None]:
    from torchfleet.tensor_memory import TensorMemory

    try:
        with TensorMemory(model, optimizer, whole_process=True) as memory:  # the process is a rank
            for _ in range(MEMORY_STEPS):
                step()
    except Exception as exc:  # noqa: BLE001 (should MemTracker refuse a strategy, the row says so)
        return None, f"tensor memory not measurable under this strategy ({first_line(exc)})"
    return memory.peak_bytes(device), None


def first_line(exc: BaseException) -> str:
    """An exception's first line (its type where it has no message), at most 120 characters: for a row's note."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]


def run_cell(cell, spec: dict, timeout_s: float) -> dict:
    """Run one bench cell for the check; a row with status ok or failed (and why), never an exception."""
    from torchfleet.bench.launch_cell import _Deadline, failure_reason
    from torchfleet.launcher.agent import LaunchError, launch

    spec = {
        **spec,
        "strategy": cell.strategy,
        "processes": cell.processes,
        "global_batch": cell.global_batch,
        "threads": cell.threads,
    }
    start = time.perf_counter()
    try:
        with _Deadline(timeout_s) as deadline:
            figures = launch(run_check_cell, nprocs=cell.processes, args=(spec,))[0]
    except LaunchError as exc:
        why = f"timed out after {timeout_s:g} s" if deadline.expired else failure_reason(exc.summary)
        return {"status": "failed", "error": why, "wall_s": time.perf_counter() - start}
    return {"status": "ok", "error": None, **figures, "wall_s": time.perf_counter() - start}


def compare(prediction, measured: dict) -> dict:
    """One row of the check: predicted and measured step time and peak memory, and their ratios."""
    row = {
        "strategy": prediction.strategy,
        "processes": prediction.processes,
        "global_batch": prediction.global_batch,
        "degrees": prediction.degrees,
        "status": measured["status"],
        "error": measured.get("error"),
        "predicted_step_s": prediction.time["step"],
        "measured_step_s": None,
        "step_ratio": None,
        "predicted_peak_bytes": prediction.memory["peak"],
        "measured_peak_bytes": None,
        "memory_ratio": None,
        "memory_note": measured.get("memory_note"),
        "microbatches": measured.get("microbatches"),
        "measured_fastest_step_s": None,
        "fastest_ratio": None,
        "spread": measured.get("spread"),
        "others_cores": measured.get("others_cores"),
        "flags": [],
        "flag_reasons": [],
    }
    if measured["status"] != "ok":
        return row
    row["measured_step_s"] = measured["step_time_median_s"]
    row["step_ratio"] = prediction.time["step"] / measured["step_time_median_s"]
    row["measured_fastest_step_s"] = measured.get("step_time_min_s")
    if row["measured_fastest_step_s"]:
        row["fastest_ratio"] = prediction.time["step"] / row["measured_fastest_step_s"]
    peaks = measured.get("peak_tensor_bytes")
    if peaks:
        row["measured_peak_bytes"] = max(peaks)
        # A traced layout gives two figures (plan/layout_trace.py): the step's as its collectives free their
        # buffers promptly, and with Gloo freeing one late, which some steps do. The nearer is the prediction met.
        figures = [prediction.memory["peak"], prediction.memory.get("peak_freed_promptly", prediction.memory["peak"])]
        row["predicted_peak_bytes"] = min(figures, key=lambda f: abs(f / max(peaks) - 1))
        row["memory_ratio"] = row["predicted_peak_bytes"] / max(peaks)
    return row


def flag(rows: list[dict], cores: int, gpus: int) -> None:
    """Each measured row's flags and their reasons, as bench's (bench/verdict.py), in place: speedups over the
    serial cell of the same batch, the steps' spread, other processes' load."""
    from torchfleet.bench.verdict import flag as bench_flag
    from torchfleet.strategies.registry import REFERENCE

    serial = {
        r["global_batch"]: r["measured_step_s"] for r in rows if r["strategy"] == REFERENCE and r["status"] == "ok"
    }
    shaped = [
        {
            **r,
            "precision": "fp32",
            "device": "cuda" if gpus else "cpu",
            "speedup": serial[r["global_batch"]] / r["measured_step_s"] if r["global_batch"] in serial else None,
        }
        if r["status"] == "ok"
        else r
        for r in rows
    ]
    bench_flag(shaped, cores, gpus)
    for row, judged in zip(rows, shaped, strict=True):
        row["flags"], row["flag_reasons"] = judged["flags"], judged["flag_reasons"]


def summary(rows: list[dict]) -> dict:
    """Median and worst |predicted / measured - 1| for step time and for peak memory; which cells are flagged."""
    out: dict[str, Any] = {"flagged": [_name(r) + f" ({', '.join(r['flags'])})" for r in rows if r.get("flags")]}
    for what, key in (("step_time", "step_ratio"), ("peak_memory", "memory_ratio"), ("fastest_step", "fastest_ratio")):
        measured = [r for r in rows if r.get(key) is not None]
        if not measured:
            out[what] = {"cells": 0, "median_error": None, "worst": None}
            continue
        errors = [abs(r[key] - 1) for r in measured]
        worst = max(measured, key=lambda r: abs(r[key] - 1))
        out[what] = {
            "cells": len(measured),
            "median_error": statistics.median(errors),
            "worst": {k: worst[k] for k in ("strategy", "processes", "global_batch", key)}
            | {"error": abs(worst[key] - 1)},
        }
    return out


def _name(row: dict) -> str:
    return f"{row['strategy']} x{row['processes']} at batch {row['global_batch']}"
