"""`--dashboard [PORT]`: the page served by the main rank, on 127.0.0.1 only, while the run trains.

When the run ends the server goes with the process, so the main rank first writes the page as it stands
then, as one HTML file (report's static page: the same charts, plotly.js inside): beside the
--metrics-out file, where `torchfleet report` would write it, or else in the temporary directory, and
a line at the run's end names the file. A run of 4 s is over before a browser opened after its first line
gets there.

The app is bottle's (one module, no dependencies of its own); it runs on the
standard library's WSGI server, one thread per request, in a daemon thread
beside training, so the loop's only cost is `publish`, which files the
window's rows under a lock. Building the charts happens on the server's
thread when the page asks (every page.POLL_MS, and only when something is new).
That thread shares the main rank's interpreter with training, and a drawing
takes 40 to 110 ms (8 ranks, 50 to 2,000 windows), so it is rationed: after a
drawing that took t seconds the next waits (1 / REDRAW_SHARE - 1) x t, which
holds the page's cost to REDRAW_SHARE of the main rank's time. Without it, on
the 2-core machine a page left open made rank 0 a compute straggler. t is the
drawing thread's CPU time, not the clock's: on a busy machine the clock counts
the other processes' turns too. A first drawing of 3 s of clock under six busy
processes held the next for 297 s, and the page showed no rank for five
minutes. The first drawing, which imports plotly, is not rationed.

What it exposes (docs/guides/security.md): the run's per-rank timings, memory,
host names and verdicts, read-only, to processes on this machine. It binds
127.0.0.1 and never another address, also on many machines (from another
machine, forward it: ssh -L PORT:127.0.0.1:PORT HOST), and it answers only
requests whose Host is 127.0.0.1 or localhost, so a web page that rebinds
its own name to 127.0.0.1 in a browser on this machine cannot read it.
"""

from __future__ import annotations

import errno
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from socketserver import ThreadingMixIn
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from torchfleet.errors import UsageError
from torchfleet.view import check_installed
from torchfleet.view.figures import payload
from torchfleet.view.page import live_page, static_page
from torchfleet.view.rows import RunRows

HOST = "127.0.0.1"
DEFAULT_PORT = 8050
RECENT = 10  # the phase chart's windows: the run so far would bury a rank that turned slow late
REDRAW_SHARE = 0.01  # of the main rank's time, at most, spent drawing the page's charts
_ALLOWED_HOSTS = ("127.0.0.1", "localhost")


def dashboard_port(text: str | int) -> int:
    """--dashboard's value as a port (argparse's type= for it): 1 to 65535, or 0 for one the OS picks."""
    value = str(text).strip()
    if not value.isdigit() or int(value) > 65535:
        raise UsageError(
            f"--dashboard {text!r} is not a port; give a number from 1 to 65535 (0: any free port),"
            f" or --dashboard alone for {DEFAULT_PORT}"
        )
    return int(value)


def check_serves_here(node_rank: int, main_here: bool = True) -> None:
    """Refuse --dashboard on a process that holds no main rank: the page is served where rank 0 runs,
    node 0 of a job (`main_here` False: a command whose processes report to another's main rank)."""
    if node_rank != 0 or not main_here:
        where = f"node {node_rank} (--node-rank {node_rank})" if node_rank != 0 else "this process"
        raise UsageError(
            f"--dashboard is served by the main rank, on node 0, and {where} runs none; give --dashboard"
            " to node 0's command"
        )


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the standard library's name
        pass  # a line per poll would bury the run's own output


class _Threads(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a page left open never keeps the run from ending


class DashboardServer:
    """The live page on 127.0.0.1:`port` (0: a free one; `url` says which), from the rows `publish` hands it.

    The port is bound at construction, so a port in use is one sentence before any training;
    `start` serves it from a daemon thread, `close` stops it (or use it as a context manager).
    """

    def __init__(self, port: int = DEFAULT_PORT, title: str = "torchfleet: ranks", redraw_share: float = REDRAW_SHARE):
        check_installed("--dashboard")
        self._redraw_gap = 1 / redraw_share - 1  # seconds of waiting per second of drawing; 0 at a share of 1
        self._next_draw = 0.0  # time.monotonic() from which a new version may be drawn
        self.drawing_s = 0.0  # the last drawing's seconds
        self.title = title
        self.rows = RunRows()
        self._lock = threading.Lock()
        self._version = 0
        self._drawn: tuple[int, str] | None = None  # (version, payload) last sent, so each new poll costs nothing
        self._thread: threading.Thread | None = None
        try:
            self._server = make_server(HOST, port, self._app(), server_class=_Threads, handler_class=_Quiet)
        except OSError as exc:
            raise _refusal(port, exc) from None
        self.port = self._server.server_port
        self.url = f"http://{HOST}:{self.port}/"

    def publish(self, rows: Iterable[Mapping]) -> None:
        """A log window's rows (rank, straggler, train rows; rows.py): the page shows them at its next poll."""
        with self._lock:
            if self.rows.add(rows):
                self._version += 1

    def start(self) -> DashboardServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="torchfleet-dashboard", daemon=True)
        self._thread.start()
        print(
            f"torchfleet: the dashboard is at {self.url} (127.0.0.1 only, read-only, no authentication; from"
            f" another machine: ssh -L {self.port}:127.0.0.1:{self.port} THIS_HOST)",
            file=sys.stderr,
        )
        return self

    def keep(self, metrics_out: str | None = None) -> Path | None:
        """Write the page as it stands to one HTML file (final_page's path) and say where; None if it cannot."""
        path = final_page(metrics_out)
        with self._lock:
            rows = self.rows.copy()
        try:
            path.write_text(static_page(self.title, payload(rows)))
        except OSError as exc:
            print(f"torchfleet: the dashboard's last page could not be written to {path} ({exc})", file=sys.stderr)
            return None
        print(
            f"torchfleet: the run is over and {self.url} with it; its last page, the same charts, is {path}"
            " (open it in a browser)",
            file=sys.stderr,
        )
        return path

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _payload(self) -> tuple[int, str]:
        """The figures of the newest version, or of the last drawn while the drawing's ration is spent; drawn
        outside the lock, so `publish` never waits for plotly."""
        with self._lock:
            if self._drawn is not None and (self._drawn[0] == self._version or time.monotonic() < self._next_draw):
                return self._drawn
            version, rows, first = self._version, self.rows.copy(), self._drawn is None
        start = time.thread_time()
        drawn = (version, payload(rows, RECENT))
        cost = time.thread_time() - start
        with self._lock:
            self._drawn, self.drawing_s = drawn, cost
            # The first drawing carries plotly's import, once: rationed, it held a busy run's page empty for 300 s.
            self._next_draw = time.monotonic() + (0.0 if first else cost * self._redraw_gap)
        return drawn

    def _app(self):
        """The three addresses: the page, plotly.js (from the plotly package: no network needed), the figures.
        Routes are added by call rather than by bottle's decorators, whose types the checker cannot read."""
        import bottle

        app = bottle.Bottle()
        app.add_hook("before_request", _only_loopback_names)
        app.route("/", "GET", lambda: live_page(self.title))
        app.route("/plotly.min.js", "GET", _plotly_js)
        app.route("/figures.json", "GET", self._figures)
        return app

    def _figures(self) -> str:
        """The page's payload, or 204 (nothing new) when the page names the version it holds."""
        import bottle

        version, text = self._payload()
        if parse_qs(bottle.request.environ.get("QUERY_STRING", "")).get("version") == [str(version)]:
            bottle.response.status = 204
            return ""
        bottle.response.content_type = "application/json"
        bottle.response.set_header("X-Version", str(version))
        bottle.response.set_header("Cache-Control", "no-store")
        return text


def final_page(metrics_out: str | None) -> Path:
    """Where the dashboard's last page goes: the metrics file's name with .html (as `torchfleet report`
    writes it), or a file of its own in the temporary directory."""
    if metrics_out:
        return Path(metrics_out).with_suffix(".html")
    return Path(tempfile.gettempdir()) / f"torchfleet-dashboard-{time.strftime('%Y%m%d-%H%M%S')}.html"


def _only_loopback_names() -> None:
    import bottle

    host = bottle.request.get_header("Host", "").rsplit(":", 1)[0]
    if host not in _ALLOWED_HOSTS:
        bottle.abort(403, "this page answers requests for 127.0.0.1 or localhost only")


def _plotly_js() -> str:
    import bottle
    from plotly.offline import get_plotlyjs

    bottle.response.content_type = "application/javascript"
    bottle.response.set_header("Cache-Control", "max-age=86400")
    return get_plotlyjs()


def _refusal(port: int, exc: OSError) -> UsageError:
    if exc.errno == errno.EADDRINUSE:
        return UsageError(
            f"--dashboard {port}: port {port} on {HOST} is in use; give another port, or 0 for any free one"
        )
    if exc.errno == errno.EACCES:
        return UsageError(f"--dashboard {port}: this user may not listen on port {port}; give a port above 1023")
    return UsageError(f"--dashboard {port}: cannot listen on {HOST}:{port} ({exc.strerror or exc})")
