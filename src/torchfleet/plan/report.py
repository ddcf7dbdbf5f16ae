"""What `torchfleet plan` shows and writes: the prediction table, the check's table, JSON and the chart."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table


def _mib(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def table(document: dict) -> Table:
    t = Table(
        title=f"torchfleet plan: {document['model']}"
        + (f" {document['gpt_preset']}" if document.get("gpt_preset") else "")
        + f", global batch {document['global_batch']}, {document['optimizer']}, on {document['target']['name']}"
        " (predicted; state = parameters + gradients + optimizer state)",
        title_justify="left",
    )
    for name, right in (
        ("strategy", False),
        ("procs", True),
        ("degrees", False),
        ("state", True),
        ("activ.", True),
        ("buffers", True),
        ("peak/rank", True),
        ("fits", False),
        ("max batch", True),
        ("compute ms", True),
        ("comm ms", True),
        ("bubble ms", True),
        ("step ms", True),
        ("samples/s", True),
        ("effic.", True),
    ):
        t.add_column(name, justify="right" if right else "left")
    for p in document["predictions"]:
        m, s = p["memory"], p["time"]
        t.add_row(
            p["strategy"],
            str(p["processes"]),
            p["degrees"],
            _mib(m["training_state"]),
            _mib(m["activations"]),
            _mib(m["buffers"]),
            _mib(m["peak"]),
            "yes" if p["fits"] else "NO",
            "-" if p["largest_batch"] is None else f"{p['largest_batch']:,}",
            _ms(s["compute"] - s["bubble"]),
            _ms(s["communication"]),
            _ms(s["bubble"]),
            _ms(s["step"]),
            f"{p['samples_per_s']:,.1f}",
            "-" if p["efficiency"] is None or p["processes"] == 1 else f"{p['efficiency']:.0%}",
        )
    return t


def check_table(check: dict) -> Table:
    t = Table(
        title="predicted against measured (bench's cells here; memory: peak tensor bytes, the largest rank)",
        title_justify="left",
    )
    for name, right in (
        ("strategy", False),
        ("procs", True),
        ("batch", True),
        ("step ms pred", True),
        ("step ms meas", True),
        ("pred/meas", True),
        ("peak pred", True),
        ("peak meas", True),
        ("pred/meas ", True),
        ("note", False),
    ):
        t.add_column(name, justify="right" if right else "left")
    for r in check["cells"]:
        ratio = "-" if r["step_ratio"] is None else f"{r['step_ratio']:.2f}"
        mem_ratio = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}"
        note = r["error"] or ", ".join(f"flag: {f}" for f in r.get("flags") or ()) or (r["memory_note"] or "")
        t.add_row(
            r["strategy"],
            str(r["processes"]),
            str(r["global_batch"]),
            _ms(r["predicted_step_s"]),
            _ms(r["measured_step_s"]),
            ratio,
            _mib(r["predicted_peak_bytes"]),
            _mib(r["measured_peak_bytes"]),
            mem_ratio,
            note[:60],
        )
    return t


def check_sentences(summary: dict) -> list[str]:
    flagged = summary.get("flagged")
    out = (
        [
            f"{len(flagged)} cells flagged, their step times in doubt (bench's flags; the lines above say why):"
            f" {'; '.join(flagged)}"
        ]
        if flagged
        else []
    )
    for what, label in (("step_time", "step time"), ("peak_memory", "peak memory"), ("fastest_step", "fastest step")):
        if what not in summary:
            continue
        s = summary[what]
        if not s["cells"]:
            out.append(f"{label}: no cell measured")
            continue
        w = s["worst"]
        out.append(
            f"{label}: median |predicted/measured - 1| = {s['median_error']:.3f} over {s['cells']} cells;"
            f" worst {w['strategy']} x{w['processes']} at batch {w['global_batch']} ({w['error']:.3f})"
        )
    return out


def write_json(document: dict, path: str) -> None:
    clean = {k: v for k, v in document.items() if not k.startswith("_")}
    Path(path).write_text(json.dumps(clean, indent=1, default=str) + "\n")


def chart(document: dict, path: str) -> str:
    """Predicted throughput and memory per rank against processes, a line per strategy; the path, or why none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib draws it)"
    preds = document["predictions"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for name in dict.fromkeys(p["strategy"] for p in preds):
        mine = sorted((p for p in preds if p["strategy"] == name), key=lambda p: p["processes"])
        xs = [p["processes"] for p in mine]
        top.plot(xs, [p["samples_per_s"] for p in mine], marker="o", label=name)
        bottom.plot(xs, [p["memory"]["peak"] / 2**20 for p in mine], marker="o", label=name)
    target = document["target"]
    limit = target["memory_bytes"] if target.get("rate") is not None else None
    if limit:
        bottom.axhline(limit / 2**20, color="gray", linestyle="--", linewidth=1, label="device memory")
    top.set_ylabel("predicted samples/s")
    bottom.set_ylabel("predicted peak MiB per rank")
    bottom.set_xlabel("processes (devices)")
    bottom.set_xscale("log", base=2)
    top.set_title(
        f"torchfleet plan: {document['model']}, batch {document['global_batch']}, {target['name']}", fontsize=10
    )
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
