"""`torchfleet report RUN_DIR`: a finished run's page as one HTML file, from its --metrics-out file.

RUN_DIR is the directory that holds the metrics file (or the file itself):
the one .jsonl, .json or .csv file directly in it with per-rank rows. The
page is the live one's (page.py, figures.py), with plotly.js and the charts
inside the file, so it opens in a browser offline; its phase chart covers
the whole run.
"""

from __future__ import annotations

from pathlib import Path

from torchfleet import outputs
from torchfleet.errors import UsageError
from torchfleet.view.figures import payload
from torchfleet.view.page import static_page
from torchfleet.view.rows import FORMATS, RunRows, read_metrics


def find_metrics(run: Path) -> Path:
    """The metrics file `run` names, or the one in the directory `run` that holds per-rank rows."""
    if not run.exists():
        raise UsageError(f"{str(run)!r} does not exist; give a run's directory or the file --metrics-out wrote")
    if run.is_file():
        return run
    candidates = sorted(p for p in run.iterdir() if p.is_file() and p.suffix.lower() in FORMATS)
    with_ranks = [p for p in candidates if _has_ranks(p)]
    if len(with_ranks) == 1:
        return with_ranks[0]
    if not with_ranks:
        found = f" (it holds {', '.join(p.name for p in candidates)}, none with per-rank rows)" if candidates else ""
        raise UsageError(
            f"{str(run)!r} holds no metrics file with per-rank rows{found}; give the directory of a run of"
            " several processes trained with --metrics-out FILE.jsonl or .csv"
        )
    raise UsageError(
        f"{str(run)!r} holds {len(with_ranks)} metrics files with per-rank rows"
        f" ({', '.join(p.name for p in with_ranks)}); give the one to draw"
    )


def _has_ranks(path: Path) -> bool:
    try:
        return bool(read_metrics(path).ranks)
    except UsageError:
        return False


def write_report(run: str | Path, out: str | Path | None = None) -> tuple[Path, RunRows]:
    """Draw the run's page into `out` (default: beside the metrics file, its name with .html)."""
    metrics = find_metrics(Path(run))
    rows = read_metrics(metrics)
    target = Path(out) if out is not None else metrics.with_suffix(".html")
    outputs.check_writable_file(target, "--out")
    title = f"torchfleet: {metrics.name}, {len(rows.ranks)} ranks"
    outputs.write_text(target, static_page(title, payload(rows)), "--out")
    return target, rows
