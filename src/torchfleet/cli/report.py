"""The `torchfleet report` command's flags, and the call from them to view/report.py."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="a finished run's per-rank page (step time, phases, memory, replica groups, stragglers) as static HTML",
        description="Reads the per-rank rows of a run's --metrics-out file (a run of several processes writes"
        " them) and writes the page the main rank can serve live as one HTML file, plotly.js inside, so it opens"
        " offline.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="the directory that holds the run's metrics file, or the file")
    p.add_argument(
        "--out", default=None, metavar="FILE", help="where to write the page (default: the metrics file's name, .html)"
    )


def command(args) -> int:
    from torchfleet.view import check_installed
    from torchfleet.view.report import write_report

    check_installed("torchfleet report")

    path, rows = write_report(args.run, args.out)
    named = len(rows.verdicts)
    print(f"torchfleet report: {len(rows.ranks)} ranks, {named} verdict{'s' * (named != 1)}: wrote {path}")
    return 0
