"""The per-rank view: the live table on values, the --dashboard server and `torchfleet report`, and both pages
loaded in a real browser (headless Chromium from apt) that must find each rank's series."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from helpers import assert_refused_in_one_sentence, forked_torchfleet, require_module, require_system, torchfleet
from torchfleet.errors import UsageError
from torchfleet.view import figures, rows
from torchfleet.view.server import DashboardServer, check_serves_here, dashboard_port
from torchfleet.view.table import RankTable

require_module("plotly", "the page's charts need plotly (pip install 'torchfleet[dashboard]')")
require_module("bottle", "the dashboard's server needs bottle (pip install 'torchfleet[dashboard]')")

SLOW, EVERY = 2, 10  # the rank slow in data, the steps of a log window
CHARTS = ("step", "phases", "memory", "groups")


def run_rows(windows: int, start: int = 1) -> list[dict]:
    """A 4-rank run's rows as --metrics-out holds them: rank 2 waits 40 ms a step for data and the others wait
    for it in communication; rank 3's memory grows 1 MiB a window; a replica group leaves every 5th window;
    the verdict on rank 2 comes at window 3."""
    out = []
    for w in range(start, start + windows):
        step = w * EVERY
        out.append({"kind": "train", "step": step, "loss": 1.0 / w, "participants": 1 if w % 5 == 0 else 2})
        for rank in range(4):
            data, comm = (0.040, 0.002) if rank == SLOW else (0.005, 0.037)
            memory = (200 + 10 * rank + (w if rank == 3 else 0)) << 20
            out.append(
                {"kind": "rank", "step": step, "rank": rank, "host": f"node{rank // 2}", "steps": EVERY}
                | {"data_s": data, "compute_s": 0.030 + 0.001 * rank, "comm_s": comm}
                | {"step_s": data + 0.030 + 0.001 * rank + comm, "memory_bytes": memory, "memory_kind": "rss"}
            )
        if w == 3:
            out.append(verdict(step))
    return out


def verdict(step: int) -> dict:
    message = f"straggler: rank {SLOW} (host node1) is slow in data: 40.0 ms a step, 8.0 times the other ranks'"
    return {"kind": "straggler", "step": step, "rank": SLOW, "host": "node1", "phase": "data", "value": 0.04} | {
        "median": 0.005,
        "slower": 7.0,
        "windows": 3,
        "message": message,
    }


def rendered(table: RankTable) -> str:
    console = Console(record=True, width=140, color_system=None)
    console.print(table)
    return console.export_text()


def test_the_table_shows_each_rank_and_marks_the_straggler_for_its_hold():
    table = RankTable(hold=2)
    window = [r for r in run_rows(3) if r["kind"] == "rank" and r["step"] == 30]
    table.update(window, [verdict(30)])
    text = rendered(table)
    lines = {int(line.split()[1]): line for line in text.splitlines() if re.match(r"^│\s+\d\s", line)}
    assert sorted(lines) == [0, 1, 2, 3]
    # rank 2: 40 + 32 + 2 = 74 ms a step, data 40 ms of it (54%), compute 43%, communication 3%
    assert re.search(
        r"│\s+2 │ node1\s+│\s+74\.0 │ 40\.0 \(54%\) │ 32\.0 \(43%\) │\s+2\.0 \(3%\) │ 220 MiB │ << slow in data",
        lines[2],
    )
    assert "72.0 │   5.0 (7%) │ 30.0 (42%) │ 37.0 (51%) │ 200 MiB" in lines[0] and "<<" not in lines[0]
    assert "233 MiB" in lines[3]  # 230 MiB and 3 windows of 1 MiB growth
    assert "ranks at step 30" in text
    table.update([{**r, "step": 40} for r in window])  # a window without a verdict: the mark holds
    assert "<< slow in data" in rendered(table)
    table.update([{**r, "step": 50} for r in window])
    assert "<<" not in rendered(table)
    table.update([], [{"kind": "straggler", "step": 60, "phase": "membership", "message": "a group left: 1 now"}])
    assert "a group left: 1 now" in rendered(table)


def test_the_table_takes_csv_text_and_redraws_in_place_under_live():
    screen = io.StringIO()
    table = RankTable(console=Console(file=screen, width=140, force_terminal=True, color_system=None))
    text_rows = [{k: str(v) for k, v in r.items()} for r in run_rows(2) if r["kind"] == "rank"]
    with table.live():
        table.update(text_rows[:4])
        table.update(text_rows[4:])
    drawn = screen.getvalue()
    assert "ranks at step 10" in drawn
    last = drawn[drawn.rindex("ranks at step 20") :]
    assert "231 MiB" not in last and "232 MiB" in last  # the last drawing is the second window's
    assert "\x1b[1A\x1b[2K" in drawn  # rich moved the cursor up over the old table: redrawn in place


def test_the_figures_hold_each_ranks_values():
    run = rows.RunRows()
    assert run.add(run_rows(12)) == 12 * 5 + 1  # 4 rank rows and a train row a window, one verdict
    step, phases, memory, groups = (figures.figures(run, recent=10)[name] for name in CHARTS)
    assert [t.name for t in step.data] == [f"rank {r} (node{r // 2})" for r in range(4)] + ["straggler named"]
    assert step.data[2].y[0] == pytest.approx(72.0 + 2.0) and list(step.data[0].x) == list(range(10, 130, 10))
    assert list(step.data[4].x) == [30] and "slow in data" in step.data[4].text[0]
    data_bar = next(t for t in phases.data if t.name == "data")
    assert list(data_bar.y) == pytest.approx([5.0, 5.0, 40.0, 5.0])
    assert memory.data[3].y[-1] == pytest.approx(242.0) and memory.data[0].y[-1] == pytest.approx(200.0)
    assert list(groups.data[0].y[:6]) == [2, 2, 2, 2, 1, 2]
    # as the loop holds them: RankWindow.row() and Verdict.row() carry no kind
    bare = rows.RunRows()
    assert bare.add({k: v for k, v in r.items() if k != "kind"} for r in run_rows(12) if r["kind"] != "train") == 49
    assert bare.ranks == run.ranks and bare.verdicts == run.verdicts
    page = json.loads(figures.payload(run))
    assert page["status"] == "4 ranks on 2 hosts, step 120; 1 straggler verdict"
    assert set(page["figures"]) == set(CHARTS)


def test_rows_read_the_same_from_csv_and_json_lines(tmp_path):
    written = run_rows(4)
    columns = ["kind", "step", "loss", "participants", *rows.RANK_FIELDS[1:], "memory_kind", *rows.VERDICT_FIELDS[3:]]
    columns = list(dict.fromkeys(columns))
    with (tmp_path / "m.csv").open("w", newline="") as f:
        out = csv.DictWriter(f, columns)
        out.writeheader()
        out.writerows(written)
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written) + '{"kind": "rank", "st')
    from_csv, from_json = rows.read_metrics(tmp_path / "m.csv"), rows.read_metrics(tmp_path / "m.jsonl")
    assert from_csv.ranks == from_json.ranks and from_csv.groups == from_json.groups
    assert from_csv.verdicts == from_json.verdicts and len(from_csv.verdicts) == 1
    assert from_csv.ranks[3][-1]["memory_bytes"] == 234 << 20 and from_csv.groups[-2:] == [(30, 2), (40, 2)]


def test_dashboard_refuses_bad_ports_in_one_sentence():
    assert dashboard_port("8051") == 8051 and dashboard_port("0") == 0
    for text in ("http", "-1", "70000", "80.5"):
        with pytest.raises(UsageError, match=r"is not a port; give a number from 1 to 65535") as info:
            dashboard_port(text)
        assert "\n" not in str(info.value)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=rf"^--dashboard {port}: port {port} on 127.0.0.1 is in use; give"):
            DashboardServer(port)
    with pytest.raises(UsageError, match=r"served by the main rank, on node 0, and node 1 \(--node-rank 1\) runs"):
        check_serves_here(1)
    check_serves_here(0)


def test_dashboard_listens_on_loopback_only_and_answers_loopback_names_only():
    with DashboardServer(0, redraw_share=1.0) as server:  # every version drawn at once
        assert server._server.socket.getsockname()[0] == "127.0.0.1"
        listening = _listeners(server.port)
        assert listening == {"127.0.0.1"}, listening
        assert _get(server.url, "figures.json?version=-1")[1]["X-Version"] == "0"
        server.publish(run_rows(2))
        status, headers, body = _get(server.url, "figures.json?version=0")
        assert status == 200 and headers["X-Version"] == "1" and "rank 3 (node1)" in body
        assert _get(server.url, "figures.json?version=1")[0] == 204
        assert _get(server.url, "", host=f"rebound.example:{server.port}")[0] == 403
        assert _get(server.url, "", host=f"localhost:{server.port}")[0] == 200


def test_the_page_is_redrawn_within_its_share_of_the_main_ranks_time():
    with DashboardServer(0, redraw_share=0.05) as server:  # 19 s of waiting per second of drawing
        server.publish(run_rows(2))
        assert _get(server.url, "figures.json?version=-1")[1]["X-Version"] == "1"
        server.publish(run_rows(1, start=3))  # the first drawing (plotly's import) is not rationed: drawn at once
        assert _get(server.url, "figures.json?version=1")[1]["X-Version"] == "2"
        assert server.drawing_s > 0
        server.publish(run_rows(1, start=4))  # version 3, right after a drawing: the ration is spent
        waiting = server._next_draw - time.monotonic()
        assert 0 < waiting <= 19 * server.drawing_s
        assert _get(server.url, "figures.json?version=-1")[1]["X-Version"] == "2"
        assert _get(server.url, "figures.json?version=2")[0] == 204  # nothing new for the page yet
        time.sleep(max(0.0, server._next_draw - time.monotonic()) + 0.01)
        status, headers, _ = _get(server.url, "figures.json?version=2")
        assert status == 200 and headers["X-Version"] == "3"


def test_a_drawing_is_rationed_by_its_cpu_time_not_the_clocks(monkeypatch):
    # On a busy machine a drawing's clock time is mostly other processes' turns: 3 s of clock held the next
    # drawing 297 s and a real run's page stayed empty. Here half a second of waiting stands for them.
    from torchfleet.view import server as served

    drawn = served.payload
    monkeypatch.setattr(served, "payload", lambda *a: (time.sleep(0.5), drawn(*a))[1])
    with DashboardServer(0, redraw_share=0.01) as server:  # 99 s of waiting per second of drawing
        for version in (1, 2):  # the first drawing is not rationed; the second is
            server.publish(run_rows(1, start=version))
            assert _get(server.url, f"figures.json?version={version - 1}")[1]["X-Version"] == str(version)
        assert server.drawing_s < 0.25  # the plotly figures' own CPU time, without the sleep
        assert server._next_draw - time.monotonic() < 99 * 0.25


def _get(url: str, path: str, host: str | None = None) -> tuple[int, dict, str]:
    request = urllib.request.Request(url + path, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, dict(answer.headers), answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, dict(refused.headers), ""


def _listeners(port: int) -> set[str]:
    """The addresses listening on `port`, from /proc/net/tcp and tcp6 (state 0A: LISTEN)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, at = local.split(":")
            if state == "0A" and int(at, 16) == port:
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]) if len(address) == 8 else address)
    return found


@pytest.mark.parametrize("case", ["missing", "no-rank-rows", "not-metrics", "two-files"])
def test_report_refuses_bad_input_in_one_sentence(case, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    if case == "no-rank-rows":
        (run / "m.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
        target, sentence = run / "m.jsonl", 'holds no per-rank rows (kind "rank")'
    elif case == "not-metrics":
        (run / "notes.txt").write_text("hello\n")
        target, sentence = run / "notes.txt", "is not a metrics file; give the .jsonl or .csv file"
    elif case == "two-files":
        for name in ("a.jsonl", "b.jsonl"):
            (run / name).write_text("".join(json.dumps(r) + "\n" for r in run_rows(1)))
        target, sentence = run, "holds 2 metrics files with per-rank rows (a.jsonl, b.jsonl); give the one to draw"
    else:
        target, sentence = tmp_path / "gone", "does not exist; give a run's directory or the file --metrics-out wrote"
    assert_refused_in_one_sentence(forked_torchfleet("report", str(target)), sentence)
    if case == "no-rank-rows":  # a directory holding only that file says so too
        assert_refused_in_one_sentence(
            forked_torchfleet("report", str(run)), "holds no metrics file with per-rank rows"
        )


# ---- in a real browser


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        require_system("the page tests need headless Chromium (apt-get install chromium; make system-deps)")
    return found


def dom(url: str, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran (5 s of virtual time: plotly draws, the live page polls)."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000"]
    if screenshot is not None:
        run = [chromium(), *flags, "--window-size=1280,1000", f"--screenshot={screenshot}", url]
        subprocess.run(run, capture_output=True, timeout=120, check=True)
    done = subprocess.run([chromium(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def series(page: str) -> dict[str, list[str]]:
    """Each chart's legend, as plotly drew it into the DOM (SVG text, not the figure JSON a script holds)."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'<div id="(step|phases|memory|groups)"', page)]
    ends = [s for s, _ in starts[1:]] + [page.index('id="verdicts"')]
    return {
        name: re.findall(r'<text class="legendtext"[^>]*>([^<]*)</text>', page[start:end])
        for (start, name), end in zip(starts, ends, strict=True)
    }


def assert_the_page_drew_the_run(page: str) -> None:
    drawn = series(page)
    ranks = [f"rank {r} (node{r // 2})" for r in range(4)]
    assert drawn["step"] == [*ranks, "straggler named"], drawn
    assert drawn["memory"] == ranks and sorted(drawn["phases"]) == ["communication", "compute", "data"], drawn
    assert re.search(r'<g class="xtick"><text[^>]*>rank 2 \(node1\)</text>', page)  # the phase chart's bars
    assert drawn["step"] and page.count('class="trace scatter') >= 4 + 1 + 4 + 1
    assert re.search(r"<li>straggler: rank 2 \(host node1\) is slow in data: 40\.0 ms", page)


@pytest.mark.timeout(400)
def test_the_live_page_in_chromium_draws_every_ranks_series_during_a_run(tmp_path):
    chromium()
    with DashboardServer(0) as server:
        stop = threading.Event()

        def train() -> None:  # a window every 0.1 s while the browser loads and polls
            for w in range(1, 10_000):
                server.publish(run_rows(1, start=w))
                if stop.wait(0.1):
                    return

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        try:
            page = dom(server.url, screenshot=tmp_path / "dashboard.png")
        finally:
            stop.set()
            trainer.join()
    assert_the_page_drew_the_run(page)
    assert re.search(r'<div id="status">4 ranks on 2 hosts, step \d+; 1 straggler verdict</div>', page), page[:3000]
    assert (tmp_path / "dashboard.png").stat().st_size > 20_000


@pytest.mark.timeout(400)
def test_the_report_page_in_chromium_draws_every_ranks_series(tmp_path):
    chromium()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run_rows(12)))
    (run / "result.json").write_text("{}")  # another JSON file beside it, without rank rows
    done = forked_torchfleet("report", str(run))
    assert done.returncode == 0, done.stderr
    written = run / "metrics.html"
    assert done.stdout.strip() == f"torchfleet report: 4 ranks, 1 verdict: wrote {written}"
    started = time.perf_counter()
    page = dom(written.as_uri())
    assert_the_page_drew_the_run(page)
    assert '<div id="status">4 ranks on 2 hosts, step 120; 1 straggler verdict</div>' in page
    assert time.perf_counter() - started < 120


@pytest.mark.waits  # on chromium and a training run's processes: 165 s of CI's wall for 14 CPU-seconds
@pytest.mark.timeout(400)
def test_the_page_of_a_real_training_run_draws_its_ranks_in_chromium(tmp_path):
    """`train --dashboard` on 2 processes: the main rank serves the page while it trains, and the browser
    finds both ranks' series, as the ranks' own figures made them (no synthetic rows)."""
    chromium()
    with socket.socket() as probe:  # a free port for the run to serve on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torchfleet", "train", "--strategy", "ddp", "-n", "2", "--model", "mlp"]
    command += ["--epochs", "100000", "--log-every", "2", "--no-progress", "--dashboard", str(port)]  # ended below
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the first windows are in
            assert run.poll() is None, run.stderr.read() if run.stderr else ""
            try:
                if _get(url, "figures.json")[0] == 200 and "rank 1 (" in _get(url, "figures.json")[2]:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the run's page had no figures of rank 1 after 120 s: " + _get(url, "figures.json")[2][:300])
        page = dom(url, screenshot=tmp_path / "run.png")
    finally:
        run.terminate()
        run.wait(timeout=60)
    drawn = series(page)
    host = socket.gethostname()
    assert drawn["step"][:2] == [f"rank 0 ({host})", f"rank 1 ({host})"], drawn
    assert drawn["memory"] == [f"rank 0 ({host})", f"rank 1 ({host})"], drawn


@pytest.mark.timeout(120)
def test_the_dashboards_page_outlives_a_short_run(tmp_path):
    """The README's `train --dashboard` ends in seconds, its server with it: the page as it stood at the end
    is written beside the metrics file, and the run's last lines say where."""
    metrics = tmp_path / "run.jsonl"
    done = torchfleet(
        "train", "--strategy", "ddp", "-n", "2", "--model", "mlp", "--max-steps", "12", "--log-every", "2",
        "--no-progress", "--dashboard", "0", "--metrics-out", str(metrics), timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    kept = tmp_path / "run.html"
    said = " ".join(done.stderr.split())
    assert f"its last page, the same charts, is {kept} (open it in a browser)" in said
    page = kept.read_text()
    host = socket.gethostname()
    # report's static page of the same rows: both ranks' series to step 12, plotly inside
    assert f"rank 0 ({host})" in page and f"rank 1 ({host})" in page and "step 12" in page
    assert "plotly" in page and len(page) > 1_000_000


def test_train_refuses_a_dashboard_it_cannot_serve_before_any_process_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_refused_in_one_sentence(
            forked_torchfleet("train", "--strategy", "ddp", "-n", "2", "--dashboard", str(port)),
            f"--dashboard {port}: port {port} on 127.0.0.1 is in use",
        )
    node_1 = ("--node-rank", "1", "--nnodes", "2", "--master-addr", "127.0.0.1")
    assert_refused_in_one_sentence(
        forked_torchfleet("train", "--strategy", "ddp", "--dashboard", *node_1), "node 1 (--node-rank 1) runs none"
    )
