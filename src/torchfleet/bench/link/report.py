"""bench's link mode on node 0: the machines' figures combined, the table, the verdict, results.json.

Derived figures, for each cell that ran on every machine:
  step time      per block of sync_every steps, the slower machine's block time / sync_every; the median,
                 quartiles and extremes over the blocks (measure_on_machine.py says why blocks)
  samples_per_s  = global batch / median step time (tokens_per_s: x the preset's block size, for gpt)
  speedup_vs_ddp = ddp's median step time / this cell's
  compute_step_s = the slower machine's median compute-only step (measure_on_machine.py's probe)
  comm_share     = 1 - compute_step_s / median step time: the share of a step the machines spend
                   exchanging (or, for PowerSGD, compressing), after whatever overlap the strategy achieves
"""

from __future__ import annotations

import datetime
import json
import statistics
from dataclasses import asdict
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from torchfleet.bench.link.job import BASELINE, MEETING_CELLS, LinkJob, Machines
from torchfleet.bench.link.measure import Link
from torchfleet.bench.measure_cell import spread
from torchfleet.bench.report import throughput, throughput_unit
from torchfleet.models import TOKEN_MODELS

SCHEMA = "torchfleet-bench-link/1"
# Every cell object in results.json has exactly these fields (None where a figure does not apply).
FIELDS = (
    "cell",
    "label",
    "options",
    "model",
    "machines",
    "processes_per_machine",
    "global_batch",
    "local_batch",
    "precision",
    "threads_per_process",
    "warmup",
    "steps",
    "block_steps",
    "status",
    "error",
    "step_time_median_s",
    "step_time_q1_s",
    "step_time_q3_s",
    "step_time_min_s",
    "step_time_max_s",
    "step_time_mean_s",
    "samples_per_s",
    "tokens_per_s",
    "speedup_vs_ddp",
    "compute_step_s",
    "comm_share",
    "comm_method",
    "device",
    "backend",
    "notes",
    "load_avg",
    "cores",
    "wall_s",
)
# A machine whose load average passes its cores by half again had other work on them during the cell.
BUSY = 1.5
COMM_METHOD = (
    "1 - the median compute-only step (the same batch through a private copy of the model, no"
    " process group, once per block) / the median step"
)


def combine(cell: str, plan: LinkJob, machines: Machines, parts: list[dict | None]) -> dict:
    """One row from every machine's post for `cell` (meeting.gather's list, None for a machine that said nothing)."""
    row = {
        "cell": cell,
        "label": plan.label(cell),
        "options": plan.fleet_options(cell),
        "model": plan.model,
        "machines": machines.nnodes,
        "processes_per_machine": 1,
        "global_batch": plan.global_batch,
        "local_batch": plan.global_batch // machines.nnodes,
        "precision": plan.precision,
        "warmup": plan.warmup,
        "steps": plan.steps,
        "block_steps": plan.sync_every,
        "wall_s": max((p["wall_s"] for p in parts if p), default=None),
    }
    failed = [(n, p) for n, p in enumerate(parts) if p is None or p["status"] != "ok"]
    if failed:
        # A machine's own failure says more than one that only saw its peer go.
        n, p = next(((n, p) for n, p in failed if p is not None), failed[0])
        why = p["error"] if p is not None else "posted no result in time (see its output)"
        return {**row, "status": "failed", "error": f"node {n}: {why}"}
    results = [p["result"] for p in parts if p is not None]
    blocks = [max(r["block_s"][b] for r in results) / plan.sync_every for b in range(plan.steps // plan.sync_every)]
    first = results[0]
    return {
        **row,
        **spread(blocks),
        "status": "ok",
        "error": None,
        "step_time_mean_s": statistics.fmean(blocks),
        "compute_step_s": max(statistics.median(r["probe_s"]) for r in results),
        "comm_method": COMM_METHOD,
        "tokens_per_sample": first["tokens_per_sample"],
        "threads_per_process": [r["threads_per_process"] for r in results],
        "device": first["device"],
        "backend": first["backend"],
        "notes": sorted({note for r in results for note in r["notes"]}),
        # the busiest machine's: it sets the pace
        **max(
            ({"load_avg": r["load_avg"], "cores": r["cores"]} for r in results),
            key=lambda m: m["load_avg"] / m["cores"],
        ),
    }


def busy(rows: list[dict]) -> str | None:
    """A note when some cell ran on a machine busy with other work, whose figures that slowed; else None."""
    loaded = [r for r in rows if r.get("load_avg") is not None and r["load_avg"] > BUSY * r["cores"]]
    if not loaded:
        return None
    said = ", ".join(f"{r['label']} (load {r['load_avg']:.1f})" for r in loaded)
    return (
        f"a machine had other work on its {loaded[0]['cores']} cores during {said}: those cells are slower than"
        " the link alone makes them; run again on idle machines to compare"
    )


def derive(rows: list[dict]) -> None:
    """Fill the derived figures of the module doc in place (None where not measurable)."""
    ok = [r for r in rows if r["status"] == "ok"]
    ddp = next((r["step_time_median_s"] for r in ok if r["cell"] == BASELINE), None)
    for r in rows:
        for name in ("samples_per_s", "tokens_per_s", "speedup_vs_ddp", "comm_share"):
            r[name] = None
        if r["status"] != "ok":
            continue
        median = r["step_time_median_s"]
        r["samples_per_s"] = r["global_batch"] / median
        if r.get("tokens_per_sample"):
            r["tokens_per_s"] = r["samples_per_s"] * r["tokens_per_sample"]
        if ddp is not None:
            r["speedup_vs_ddp"] = ddp / median
        r["comm_share"] = max(0.0, 1 - r["compute_step_s"] / median)


def line(row: dict) -> str:
    """What node 0 prints as each cell ends."""
    if row["status"] != "ok":
        return f"{row['label']}: {row['status']}: {row['error']}"
    text = f"{row['label']}: {row['step_time_median_s'] * 1e3:.1f} ms/step, {throughput(row)}"
    if row["speedup_vs_ddp"] is not None and row["cell"] != BASELINE:
        text += f", {row['speedup_vs_ddp']:.2f}x ddp"
    return text + f" (communication {row['comm_share']:.0%} of the step)"


# ---- the verdict -------------------------------------------------------------------------


def _trade(row: dict, plan: LinkJob) -> str:
    """What the winner gives up for its speed: none of them is ddp's arithmetic."""
    if row["cell"] in MEETING_CELLS:
        return (
            f"{row['cell']} trades ddp's exact arithmetic for fewer exchanges: its replica groups train apart"
            f" for {plan.sync_every} steps between meetings (docs/guides/slow-links.md)"
        )
    return (
        f"PowerSGD sends a rank-{plan.powersgd_rank} approximation of each gradient, error feedback carrying"
        " the rest to later steps"
    )


def verdict(mbit_s: float, rows: list[dict], plan: LinkJob) -> str:
    """Which cell wins on this link and by how much, in one sentence."""
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["step_time_median_s"])
    link = f"on this {mbit_s:,.0f} Mbit/s link"
    if not ok:
        return f"{link} no cell ran, so there is no verdict; each row says why."
    best = ok[0]
    ddp = next((r for r in ok if r["cell"] == BASELINE), None)
    if ddp is None:
        return (
            f"{link} {best['label']} is the fastest of the cells that ran, at"
            f" {best['step_time_median_s'] * 1e3:.1f} ms/step; ddp did not run, so there is no speed-up to give."
        )
    others = [r for r in ok if r is not best and r is not ddp]
    runner = ok[1] if len(ok) > 1 else None
    # Quartiles that overlap: on a shared machine a few blocks cannot order the two for sure.
    close = (
        (
            f" (too close to call against {runner['label']}: their blocks' quartiles overlap; more --steps would"
            " tell them apart)"
        )
        if runner is not None and best["step_time_q3_s"] >= runner["step_time_q1_s"]
        else ""
    )
    if best is ddp:
        text = (
            f"{link} ddp is the fastest{close}: the link is fast enough for its exact exchange of every gradient"
            f" every step (communication is {ddp['comm_share']:.0%} of its step)"
        )
        if others:
            text += "; " + " and ".join(f"{r['label']} runs at {r['speedup_vs_ddp']:.2f}x its speed" for r in others)
        return text + "."
    text = f"{link} {best['label']} is the fastest, {best['speedup_vs_ddp']:.2f}x ddp's speed"
    if others:
        text += ", " + " and ".join(f"{r['label']} {r['speedup_vs_ddp']:.2f}x" for r in others)
    return f"{text}{close}; {_trade(best, plan)}."


# ---- files and the table -----------------------------------------------------------------


def document(plan: LinkJob, machines: Machines, machine: dict, link: Link, rows: list[dict], notes: list[str]) -> dict:
    cells = [{field: row.get(field) for field in FIELDS} for row in rows]
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            **asdict(plan),
            "nnodes": machines.nnodes,
            "master_addr": machines.master_addr,
            "master_port": machines.master_port,
        },
        "machine": machine,  # node 0's, as doctor reports it
        "link": link.as_dict(),
        "notes": notes,
        "cells": cells,
        "verdict": verdict(link.mbit_s, cells, plan),
    }


def write_json(doc: dict, path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def table(doc: dict) -> Table:
    """One row per cell; a failed cell's reason goes in the caption, numbered."""
    cfg, link = doc["config"], doc["link"]
    model = f"{cfg['model']} {cfg['gpt_preset']}" if cfg["model"] in TOKEN_MODELS else cfg["model"]
    t = Table(
        title=f"torchfleet bench: the link between {cfg['nnodes']} machines, {link['mbit_s']:,.0f} Mbit/s"
        f" ({model}, global batch {cfg['global_batch']}, {cfg['steps']} timed steps in blocks of"
        f" {cfg['sync_every']}, 1 process per machine)",
        title_justify="left",
        caption_justify="left",
    )
    tokens = any(r.get("tokens_per_s") is not None for r in doc["cells"])
    names = (
        "cell",
        "ms/step",
        "IQR ms",
        "tokens/s" if tokens else throughput_unit(cfg["model"]),
        "vs ddp",
        "compute ms",
        "comm",
        "load",
        "status",
    )
    for name in names:
        t.add_column(name, justify="left" if name in ("cell", "status") else "right")
    reasons = []
    for r in doc["cells"]:
        ok = r["status"] == "ok"
        if not ok:
            reasons.append(f"[{len(reasons) + 1}] {r['label']}: {r['error']}")
        iqr = (r["step_time_q3_s"] - r["step_time_q1_s"]) * 1e3 if ok else None
        t.add_row(
            escape(r["label"]),
            _num(_ms(r["step_time_median_s"]), ".1f"),
            _num(iqr, ".1f"),
            _num(r["tokens_per_s" if tokens else "samples_per_s"], ",.0f"),
            _num(r["speedup_vs_ddp"], ".2f"),
            _num(_ms(r["compute_step_s"]), ".1f"),
            _num(r["comm_share"], ".0%"),
            "-" if r.get("load_avg") is None else f"{r['load_avg']:.1f}/{r['cores']}",
            "ok" if ok else f"[red]{r['status']} [{len(reasons)}][/]",
        )
    caption = [f"link: {link['method']}", f"comm: {COMM_METHOD}", *reasons]
    t.caption = escape("\n".join(caption))
    return t
