"""bench.png: samples/s by strategy and batch, each bar annotated with its speedup over serial.

matplotlib is a dependency; where it is missing anyway (an install with --no-deps), the
chart is skipped with a sentence saying how to get it.
"""

from __future__ import annotations

from pathlib import Path


def draw(rows: list[dict], path: Path, title: str = "torchfleet bench") -> str:
    """Draw the chart; return the path written, or a sentence saying why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib draws bench.png)"
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return "no chart: no cell ran"

    batches = sorted({r["global_batch"] for r in ok})
    # One bar series per set-up (strategy, processes, precision), in the order they ran.
    series = list(dict.fromkeys((r["strategy"], r["processes"], r["precision"]) for r in ok))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(batches) * len(series) ** 0.5 + 3), 4.5))
    for i, key in enumerate(series):
        xs, ys, notes = [], [], []
        for j, batch in enumerate(batches):
            found = [
                r for r in ok if (r["strategy"], r["processes"], r["precision"]) == key and r["global_batch"] == batch
            ]
            if found:
                xs.append(j + (i - (len(series) - 1) / 2) * width)
                ys.append(found[0]["samples_per_s"])
                speedup = found[0]["speedup"]
                notes.append("" if speedup is None else f"{speedup:.2f}x")
        strategy, processes, precision = key
        name = strategy if processes == 1 else f"{strategy} x{processes}"
        bars = ax.bar(xs, ys, width * 0.95, label=f"{name} {precision}")
        ax.bar_label(bars, labels=notes, fontsize=8, padding=2)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    values = [r["samples_per_s"] for r in ok]
    if max(values) > 20 * min(values):
        ax.set_yscale("log")  # tiny and large batches differ by orders of magnitude
    ax.set_ylabel("samples/s (higher is better)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="upper left")
    fig.text(
        0.99,
        0.01,
        "bar labels: speedup over serial at the same batch and precision",
        ha="right",
        fontsize=7,
        color="gray",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
