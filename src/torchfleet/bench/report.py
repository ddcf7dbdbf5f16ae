"""What `torchfleet bench` shows and writes: progress, the table, JSON and CSV (verdict.py: the flags and the
verdict they allow)."""

from __future__ import annotations

import contextlib
import csv
import datetime
import json
from dataclasses import asdict
from pathlib import Path

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from torchfleet.bench.rounds import TRIMMED_FROM, sizing
from torchfleet.bench.verdict import comm, label, throughput, throughput_unit, verdict
from torchfleet.strategies import registry

# Every cell object in results.json has exactly these fields (None where a
# figure does not apply or the cell did not run), in this order in results.csv.
FIELDS = (
    "model",
    "strategy",
    "processes",
    "global_batch",
    "local_batch",
    "precision",
    "compile",
    "optimizer",
    "channels_last",
    "threads_per_process",
    "warmup",
    "steps",
    "status",
    "error",
    "step_time_median_s",
    "step_time_q1_s",
    "step_time_q3_s",
    "step_time_min_s",
    "step_time_max_s",
    "rounds",
    "round_step_time_s",
    "round_steps",
    "spread",
    "others_cores",
    "flags",
    "flag_reasons",
    "samples_per_s",
    "tokens_per_s",
    "speedup",
    "efficiency",
    "vs_fp32",
    "flops_per_sample",
    "model_tflops",
    "mfu",
    "peak_memory_bytes",
    "memory_method",
    "comm_share",
    "comm_method",
    "device",
    "device_name",
    "backend",
    "notes",
    "first_step_s",
    "wall_s",
)
SCHEMA = "torchfleet-bench/2"  # 2: rounds, spread, others_cores, flags; machine_state; round_steps


def _cell_name(row: dict) -> str:
    return f"{label(row)}, batch {row['global_batch']}, {row['precision']}"


# ---- while it runs -----------------------------------------------------------------------


class _Bar:
    def __init__(self, console, progress: Progress, task):
        self.console, self.progress, self.task = console, progress, task

    def start(self, cell, round_index: int, rounds: int) -> None:
        name = f"round {round_index + 1} of {rounds}: {cell.strategy} x{cell.processes}, batch {cell.global_batch}"
        self.progress.update(self.task, description=escape(f"{name}, {cell.precision}"))

    def step(self) -> None:
        self.progress.advance(self.task)

    def done(self, row: dict) -> None:
        self.console.print(escape(line(row)))


@contextlib.contextmanager
def progress(console, total: int):
    """A bar over the cells' runs (on a terminal); `done` prints a cell's line once its rounds are over."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        yield _Bar(console, bar, bar.add_task("starting", total=total))


def line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{_cell_name(row)}: {row['status']}: {row['error']}"
    text = f"{_cell_name(row)}: {row['step_time_median_s'] * 1e3:.2f} ms/step, {throughput(row)}"
    if row["speedup"] is not None and row["strategy"] != registry.REFERENCE:
        text += f", {row['speedup']:.2f}x serial"
    if row.get("vs_fp32") is not None:
        text += f", {row['vs_fp32']:.2f}x its fp32 cell"
    if row.get("mfu") is not None:
        text += f", MFU {row['mfu']:.1%}"
    if row.get("spread") is not None:
        text += f", rounds within {row['spread']:.0%}"
    text += comm(row)
    reasons = row.get("flag_reasons")
    return text + (f"; flagged: {'; '.join(reasons)}" if reasons else "")


# ---- files -------------------------------------------------------------------------------


def document(cfg, machine: dict, rows: list[dict], notes: list[str], state: dict | None = None) -> dict:
    """results.json: `machine` is doctor's report, `state` how busy the machine was (machine_load.py)."""
    cells = [{field: row.get(field) for field in FIELDS} for row in rows]
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(cfg),
        "machine": machine,
        "machine_state": state,
        "notes": notes,
        "cells": cells,
        "verdict": verdict(cells, state),
    }


def write_json(doc: dict, path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, list):
        return ";".join(str(v) for v in value)
    return value


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(FIELDS)
        for row in rows:
            writer.writerow([_csv_value(row.get(field)) for field in FIELDS])


# ---- the table ---------------------------------------------------------------------------


def _mib(values) -> str:
    known = [v for v in values or () if v is not None]
    if not known:
        return "-"
    return f"{max(known) / 2**20:,.0f} MiB"  # the largest rank's


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def machine_line(machine: dict) -> str:
    cores = machine["cpu_cores"]["usable"]
    gpus = ", ".join(g["name"] for g in machine["gpus"]) or "no GPU"
    return f"{cores} CPU cores, {gpus}, torch {machine['torch']['version']}"


def chart_title(doc: dict) -> str:
    return f"torchfleet bench: {doc['config']['model']} on {machine_line(doc['machine'])}"


def table(doc: dict) -> Table:
    """One row per cell; a failed or skipped cell's reason goes in the caption, numbered."""
    compiled = doc["config"].get("compile")
    model = doc["config"]["model"] + (f", torch.compile ({compiled})" if compiled else "")
    t = Table(
        title=f"torchfleet bench: {model} ({machine_line(doc['machine'])})",
        title_justify="left",
        caption_justify="left",
    )
    tokens = any(r.get("tokens_per_s") is not None for r in doc["cells"])  # gpt: a sample is a sequence
    rate = "tokens/s" if tokens else throughput_unit(doc["config"]["model"])
    # Columns that only some runs fill: mixed precision's gain, and MFU on a GPU torchfleet knows.
    mixed = any(r.get("vs_fp32") is not None for r in doc["cells"])
    mfu = any(r.get("mfu") is not None for r in doc["cells"])
    names = (
        "strategy",
        "threads",
        "batch",
        "precision",
        "ms/step",
        "spread",
        rate,
        "speedup",
        "effic.",
        *(("vs fp32",) if mixed else ()),
        "TFLOP/s",
        *(("MFU",) if mfu else ()),
        "mem/rank",
        "comm",
        "status",
    )
    for name in names:
        t.add_column(name, justify="left" if name in ("strategy", "precision", "status") else "right")
    reasons = []
    for r in doc["cells"]:
        ok = r["status"] == "ok"
        name = r["strategy"] if r["processes"] == 1 else f"{r['strategy']} x{r['processes']}"
        if not ok or r.get("flags"):
            why = r["error"] if not ok else "; ".join(r["flag_reasons"])
            reasons.append(f"[{len(reasons) + 1}] {name}, batch {r['global_batch']}, {r['precision']}: {why}")
        median_ms = r["step_time_median_s"] * 1e3 if ok else None
        status = "ok" if ok and not r.get("flags") else f"flag [{len(reasons)}]" if ok else None
        t.add_row(
            escape(name),
            f"{r['processes']}x{r['threads_per_process']}",
            str(r["global_batch"]),
            r["precision"],
            _num(median_ms, ".2f"),
            _num(r.get("spread") if ok else None, ".0%"),
            _num(r["tokens_per_s" if tokens else "samples_per_s"], ",.0f"),
            _num(r["speedup"], ".2f"),
            _num(r["efficiency"], ".2f"),
            *((_num(r.get("vs_fp32"), ".2f"),) if mixed else ()),
            _num(r.get("model_tflops"), ".3g"),
            *((_num(r.get("mfu"), ".1%"),) if mfu else ()),
            _mib(r["peak_memory_bytes"]),
            _num(r["comm_share"], ".0%"),
            status or f"[red]{r['status']} [{len(reasons)}][/]",
        )
    t.caption = escape("\n".join([budget(doc), *reasons]))
    return t


def budget(doc: dict) -> str:
    """The thread budget of the cells: processes x intra-op threads each, on the usable cores."""
    cores = doc["machine"]["cpu_cores"]["usable"]
    used = sorted({r["processes"] * r["threads_per_process"] for r in doc["cells"] if r["status"] != "skipped"})
    rounds = doc["config"].get("rounds", 1)
    spread = f"{sizing(doc['config'])}; spread: " + (
        ("the rounds' medians' range over their median" if rounds > 1 else "the steps' IQR / median")
        + (f", the round farthest from it left out ({rounds} rounds)" if rounds >= TRIMMED_FROM else "")
    )
    if len(used) == 1:
        return f"every cell runs {used[0]} threads in all (processes x threads each) on {cores} usable cores; {spread}"
    return (
        f"the cells run {', '.join(map(str, used))} threads in all (processes x threads each; --threads sets them"
        f" per process) on {cores} usable cores: their speedups compare unequal budgets; {spread}"
    )
