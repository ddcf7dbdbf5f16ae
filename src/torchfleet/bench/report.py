"""What `torchfleet bench` shows and writes: progress, the table, JSON, CSV and the verdict."""

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

from torchfleet.models import IMAGE_MODELS, TOKEN_MODELS

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
SCHEMA = "torchfleet-bench/1"


def label(row: dict) -> str:
    name = row["strategy"]
    return name if row["processes"] == 1 else f"{name} on {row['processes']} processes"


def _cell_name(row: dict) -> str:
    return f"{label(row)}, batch {row['global_batch']}, {row['precision']}"


def throughput_unit(model: str) -> str:
    """Throughput's unit for a model: tokens/s for gpt (a sample is a sequence), images/s for the ResNets."""
    return "tokens/s" if model in TOKEN_MODELS else "images/s" if model in IMAGE_MODELS else "samples/s"


def throughput(row: dict) -> str:
    """A cell's rate with its unit, as the tables and the cell lines show it (bench's link mode too)."""
    if row.get("tokens_per_s") is not None:
        return f"{row['tokens_per_s']:,.0f} tokens/s"
    return f"{row['samples_per_s']:,.0f} {throughput_unit(row.get('model', ''))}"


def _comm(row: dict) -> str:
    share = row.get("comm_share")
    return "" if share is None else f" (communication is {share:.0%} of the step)"


# ---- while it runs -----------------------------------------------------------------------


class _Bar:
    def __init__(self, console, progress: Progress, task):
        self.console, self.progress, self.task = console, progress, task

    def start(self, cell) -> None:
        name = f"{cell.strategy} x{cell.processes}, batch {cell.global_batch}, {cell.precision}"
        self.progress.update(self.task, description=escape(name))

    def done(self, row: dict) -> None:
        self.progress.advance(self.task)
        self.console.print(escape(line(row)))


@contextlib.contextmanager
def progress(console, total: int):
    """A bar over the cells (on a terminal) and one line per finished cell (everywhere)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        yield _Bar(console, bar, bar.add_task("starting", total=total))


def line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{_cell_name(row)}: {row['status']}: {row['error']}"
    text = f"{_cell_name(row)}: {row['step_time_median_s'] * 1e3:.2f} ms/step, {throughput(row)}"
    if row["speedup"] is not None and row["strategy"] != "serial":
        text += f", {row['speedup']:.2f}x serial"
    if row.get("vs_fp32") is not None:
        text += f", {row['vs_fp32']:.2f}x its fp32 cell"
    if row.get("mfu") is not None:
        text += f", MFU {row['mfu']:.1%}"
    return text + _comm(row)


# ---- the verdict -------------------------------------------------------------------------


def verdict(rows: list[dict]) -> str:
    """The fastest cell, with the figure that explains it."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return "no cell ran, so there is no verdict; each row says why"
    best = max(ok, key=lambda r: r["samples_per_s"])
    text = (
        f"{label(best)} is the fastest for {best['model']} here: "
        f"{throughput(best)} at batch {best['global_batch']} ({best['precision']})"
    )
    if best["strategy"] == "serial":
        rivals = [r for r in ok if r["strategy"] != "serial" and r["speedup"] is not None]
        if rivals:
            top = max(rivals, key=lambda r: r["speedup"])
            text += (
                f"; the best parallel cell, {label(top)} at batch {top['global_batch']},"
                f" reaches {top['speedup']:.2f}x serial{_comm(top)}"
            )
        return text + "."
    if best["speedup"] is not None:
        text += f", {best['speedup']:.2f}x serial at the same batch{_comm(best)}"
    # How the same set-up fares at the smallest other batch says why batch size matters.
    same = sorted(
        (
            r
            for r in ok
            if r is not best
            and r["speedup"] is not None
            and (r["strategy"], r["processes"], r["precision"])
            == (best["strategy"], best["processes"], best["precision"])
        ),
        key=lambda r: r["global_batch"],
    )
    if same:
        small = same[0]
        text += f"; at batch {small['global_batch']} it is {small['speedup']:.2f}x serial{_comm(small)}"
    return text + "."


# ---- files -------------------------------------------------------------------------------


def document(cfg, machine: dict, rows: list[dict], notes: list[str]) -> dict:
    cells = [{field: row.get(field) for field in FIELDS} for row in rows]
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(cfg),
        "machine": machine,
        "notes": notes,
        "cells": cells,
        "verdict": verdict(cells),
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
        "IQR ms",
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
        if not ok:
            reasons.append(
                f"[{len(reasons) + 1}] {r['strategy']} x{r['processes']}, batch "
                f"{r['global_batch']}, {r['precision']}: {r['error']}"
            )
        iqr = (r["step_time_q3_s"] - r["step_time_q1_s"]) * 1e3 if ok else None
        median_ms = r["step_time_median_s"] * 1e3 if ok else None
        name = r["strategy"] if r["processes"] == 1 else f"{r['strategy']} x{r['processes']}"
        t.add_row(
            escape(name),
            str(r["threads_per_process"]),
            str(r["global_batch"]),
            r["precision"],
            _num(median_ms, ".2f"),
            _num(iqr, ".2f"),
            _num(r["tokens_per_s" if tokens else "samples_per_s"], ",.0f"),
            _num(r["speedup"], ".2f"),
            _num(r["efficiency"], ".2f"),
            *((_num(r.get("vs_fp32"), ".2f"),) if mixed else ()),
            _num(r.get("model_tflops"), ".3g"),
            *((_num(r.get("mfu"), ".1%"),) if mfu else ()),
            _mib(r["peak_memory_bytes"]),
            _num(r["comm_share"], ".0%"),
            "ok" if ok else f"[red]{r['status']} [{len(reasons)}][/]",
        )
    if reasons:
        t.caption = escape("\n".join(reasons))
    return t
