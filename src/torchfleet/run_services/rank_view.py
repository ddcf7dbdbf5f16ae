"""What the main rank does with every rank's records of a log window, in `torchfleet train` and in a Fleet
script alike: the rows in the metrics files, the straggler verdicts (and the busy-machine note) written and
said, and the rows published to the --dashboard page."""

from __future__ import annotations

from collections.abc import Iterable

from torchfleet.run_services.metrics import MetricsLog
from torchfleet.run_services.rank_figures import RankWindow
from torchfleet.run_services.stragglers import StragglerWatch, Verdict


class RankView:
    """One run's judge of its windows, on the main rank; `dashboard` the page's server (None without one)."""

    def __init__(self, metrics: MetricsLog, dashboard=None):
        self.metrics, self.dashboard = metrics, dashboard
        self.stragglers = StragglerWatch()

    def show(
        self, records: list[RankWindow], more: Iterable[Verdict] = (), page_rows: Iterable[dict] = ()
    ) -> tuple[list[str], list[dict], list[dict]]:
        """Judge `records` (with `more` verdicts found elsewhere: the link probe's, membership's), write every
        row, publish them to the page (with `page_rows`); the lines to say, the records' rows and the named."""
        self.metrics.ranks(records)
        verdicts = self.stragglers.judge(records) + list(more)
        lines = []
        for note in self.stragglers.machine:
            lines.append(f"torchfleet: {note.line()}")
            self.metrics.machine(note)
        for verdict in verdicts:
            lines.append(f"torchfleet: {verdict.line()}")
            self.metrics.verdict(verdict)
        rows, named = [r.row() for r in records], [v.row() for v in verdicts]
        if self.dashboard is not None:
            self.dashboard.publish(rows + named + list(page_rows))
        return lines, rows, named

    def close(self, metrics_out: str | None) -> None:
        """The run is over: the page written beside `metrics_out` (it goes with the process), its server stopped."""
        if self.dashboard is not None:
            self.dashboard.keep(metrics_out)
            self.dashboard.close()


def start_dashboard(port: str | None):
    """--dashboard's page served from this process (the main rank's), or None when not asked for."""
    if port is None:
        return None
    from torchfleet.view.server import DashboardServer, dashboard_port  # the page's code only where asked for

    return DashboardServer(dashboard_port(port)).start()
