"""What `torchfleet run` shows the user: whole lines, the port it exposes, why a rank died, and where.

Every test starts real `torchfleet run` processes, as a user would.
"""

import json
import os
import re
import select
import subprocess
import sys
import time
from collections import Counter

import pytest

from helpers import ROOT, clean_env, run
from torchfleet.netif import free_port

SCRIPTS = ROOT / "tests" / "scripts"
LINE = re.compile(r"rank ([01]) line (\d+)( w){20}")
RUN = [sys.executable, "-m", "torchfleet", "run"]


def _without_unbuffered() -> dict[str, str]:
    """The user's usual environment: no PYTHONUNBUFFERED, so Python would buffer a pipe by blocks."""
    env = clean_env()
    env.pop("PYTHONUNBUFFERED")
    return env


@pytest.mark.timeout(180)
@pytest.mark.parametrize("env", [clean_env, _without_unbuffered], ids=["PYTHONUNBUFFERED", "default"])
def test_two_ranks_printing_at_once_give_whole_lines(env):
    result = run([*RUN, "-n", "2", str(SCRIPTS / "print_lines.py"), "1000"], timeout=150, env=env())
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    broken = [line for line in lines if not LINE.fullmatch(line)]
    assert broken == [], f"{len(broken)} of {len(lines)} lines cut or mixed, e.g. {broken[:3]}"
    assert len(lines) == 2000
    numbers = {(m[1], int(m[2])) for m in map(LINE.fullmatch, lines)}
    assert Counter(rank for rank, _ in numbers) == {"0": 1000, "1": 1000}  # each line once
    # The ranks' output did overlap (the rank changes from one line to the next),
    # or whole lines would prove nothing.
    switches = sum(a[:6] != b[:6] for a, b in zip(lines, lines[1:], strict=False))
    assert switches >= 10, switches


@pytest.mark.timeout(120)
def test_a_line_arrives_while_its_rank_still_runs(tmp_path):
    """Line-buffered, not block-buffered: the line is there before the worker exits."""
    release = tmp_path / "release"
    proc = subprocess.Popen(
        [*RUN, "-n", "2", str(SCRIPTS / "print_then_wait.py"), str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_without_unbuffered(),
        cwd=ROOT,
    )
    # Raw reads, not readline: a text reader may take both ranks' lines from the pipe at
    # once and keep the second in its own buffer, which communicate() below never sees.
    seen, deadline = b"", time.monotonic() + 50
    try:
        while b"\n" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
            if not chunk:
                break
            seen += chunk
        still_running = proc.poll() is None
    finally:
        release.touch()
        out, err = proc.communicate(timeout=60)
    first = seen.decode().split("\n", 1)[0] + "\n" if b"\n" in seen else seen.decode()
    assert re.fullmatch(r"rank [01] started\n", first), (first, err)
    assert still_running
    assert proc.returncode == 0, err
    assert sorted((seen + out).decode().splitlines()) == ["rank 0 started", "rank 1 started"]


@pytest.mark.timeout(120)
def test_the_exposure_notice_names_the_port_the_store_listens_on():
    port = free_port()
    result = run(
        [*RUN, "--rdzv_endpoint", f"127.0.0.1:{port}", "-n", "1", str(SCRIPTS / "agent_ports.py")], timeout=100
    )
    assert result.returncode == 0, result.stderr
    notice = re.search(
        r"torchfleet: this machine exposes the rendezvous store on every interface, port (\d+)", result.stderr
    )
    assert notice, result.stderr
    listening = json.loads(result.stdout.splitlines()[-1])["agent_listens_on"]
    assert int(notice[1]) == port
    assert port in listening, listening


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["after", "during"])
def test_the_summary_says_whether_the_script_had_run_to_its_end(when):
    result = run([*RUN, "-n", "2", str(SCRIPTS / "abort_at_exit.py"), when], timeout=100)
    assert result.returncode == 128 + 6, result.stderr  # SIGABRT
    err = result.stderr
    assert re.search(r"rank 1 \(local rank 1 on .*\) failed first: killed by SIGABRT", err), err
    # Rank 1's own line; rank 0's may not come: on a busy machine the agent stopped it first (30 Nov).
    ended = "rank 1 reached the end of the script" in result.stdout
    if when == "after":
        assert ended, result.stdout
        assert "it had run its script to the end and died afterwards, while the process exited" in err
        assert "left no error report" not in err
    else:
        assert not ended, result.stdout
        assert "it left no error report" in err
        assert "run its script to the end" not in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["script", "module"])
def test_a_traceback_starts_at_the_users_frame(how):
    target = [str(SCRIPTS / "raise_nested.py")] if how == "script" else ["-m", "raise_nested"]
    result = run([*RUN, "-n", "1", *target], timeout=100, cwd=SCRIPTS)
    assert result.returncode == 1, result.stderr
    err = result.stderr
    assert err.count("Traceback (most recent call last):") == 1, err
    trace = err[err.index("Traceback (most recent call last):") :].splitlines()
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    assert [
        re.sub(r"^File \"(.*)\", line \d+, in (.*)$", lambda m: f"{m[1].rsplit('/', 1)[-1]} {m[2]}", f) for f in frames
    ] == ["raise_nested.py <module>", "raise_nested.py inner"], err
    assert trace[-1] == "ValueError: raised by the user's code"
    assert "runpy" not in err and "torchfleet/launcher" not in err, err
