"""Preemption outside the built-in job: a script under `torchfleet run`, and spot notices.

The script (scripts/leaves_when_told.py) asks fleet.preempted() after every step, saves with
fleet.save and goes with fleet.leave; its rank 0 sleeps in step 5 after creating a marker, so a
signal sent at the marker lands in step 5 on every run. The spot notices come from a metadata
server this test runs on loopback, speaking each cloud's protocol.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from helpers import ROOT, clean_env, torchfleet
from test_preemption import _signalled, worker
from torchfleet.checkpoint import list_checkpoints, verify
from torchfleet.errors import UsageError
from torchfleet.launcher.failures import PREEMPTED_EXIT
from torchfleet.netif import free_port
from torchfleet.worker import spot_notices

SCRIPT = str(ROOT / "tests" / "scripts" / "leaves_when_told.py")
STEPS = 12


def _run(*flags: str, ck: Path, out: Path, marker: Path | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchfleet",
        "run",
        "-n",
        "2",
        *flags,
        SCRIPT,
        str(ck),
        str(out),
        str(STEPS),
        *([str(marker)] if marker else []),
    ]


def _assert_close(a: Path, b: Path, tol: float = 1e-5) -> float:
    one, two = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert one.keys() == two.keys()
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst <= tol, worst
    return worst


@pytest.mark.timeout(400)
def test_sigterm_to_torchfleet_run_saves_exits_75_and_the_script_resumes_to_the_same_weights(tmp_path):
    # As Kubernetes sends it: SIGTERM to the pod's process, the launcher; its agent passes it on.
    ck, marker = tmp_path / "ck", tmp_path / "fired"
    result, seconds = _signalled(
        _run(ck=ck, out=tmp_path / "never.pt", marker=marker), signal.SIGTERM, marker, clean_env()
    )
    assert result.returncode == PREEMPTED_EXIT, result.stderr
    assert "Traceback" not in result.stderr and "error" not in result.stderr
    assert f"torchfleet: preempted by SIGTERM at step 5, checkpoint saved to {ck / 'step-00000005'}\n" in result.stderr
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000005"]
    verify(ck / "step-00000005")
    assert seconds < 30  # Kubernetes' default grace before SIGKILL

    resumed = torchfleet("run", "-n", "2", SCRIPT, str(ck), str(tmp_path / "resumed.pt"), str(STEPS), env=clean_env())
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 5" in resumed.stdout
    whole = torchfleet(
        "run", "-n", "2", SCRIPT, str(tmp_path / "none"), str(tmp_path / "whole.pt"), str(STEPS), env=clean_env()
    )
    assert whole.returncode == 0, whole.stderr
    _assert_close(tmp_path / "resumed.pt", tmp_path / "whole.pt")


@pytest.mark.timeout(300)
def test_a_worker_told_alone_is_not_restarted_under_max_restarts(tmp_path):
    # A signal that reaches one worker (Slurm signals every task; a node's handler may too): the ranks
    # agree, save and exit 75, and the agent ends the job instead of spending a restart on it.
    ck, marker = tmp_path / "ck", tmp_path / "fired"

    def local_rank_0(launcher: int) -> int:
        return worker(launcher, 0)

    result, _ = _signalled(
        _run("--max-restarts", "2", ck=ck, out=tmp_path / "never.pt", marker=marker),
        signal.SIGUSR1,
        marker,
        clean_env(),
        target=local_rank_0,
    )
    assert result.returncode == PREEMPTED_EXIT, result.stderr
    assert "attempt 1" not in result.stdout and "resumed" not in result.stdout  # no restart ran
    assert f"torchfleet: preempted by SIGUSR1 at step 5, checkpoint saved to {ck / 'step-00000005'}" in result.stderr
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000005"]


class _Metadata(BaseHTTPRequestHandler):
    """A cloud's metadata service: no notice for the first `quiet` reads of the notice path, then one."""

    quiet = 0
    reads = 0
    tokens: list[str] = []

    def log_message(self, *args) -> None:  # the test's output stays the job's
        pass

    def _answer(self, status: int, body: str = "") -> None:
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self) -> None:  # AWS's IMDSv2 token
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._answer(200 if ok else 400, "token-1" if ok else "")

    def do_GET(self) -> None:
        cls = type(self)
        cls.reads += 1
        notice = cls.reads > cls.quiet
        if self.path == "/latest/meta-data/spot/instance-action":
            cls.tokens.append(self.headers.get("X-aws-ec2-metadata-token", ""))
            self._answer(
                200, json.dumps({"action": "terminate", "time": "2026-11-25T06:00:00Z"})
            ) if notice else self._answer(404)
        elif self.path == "/computeMetadata/v1/instance/preempted" and self.headers.get("Metadata-Flavor") == "Google":
            self._answer(200, "TRUE" if notice else "FALSE")
        elif self.path.startswith("/metadata/scheduledevents") and self.headers.get("Metadata") == "true":
            events = [{"EventType": "Preempt", "NotBefore": "Wed, 25 Nov 2026 06:00:30 GMT"}] if notice else []
            self._answer(200, json.dumps({"DocumentIncarnation": 1, "Events": events}))
        elif self.path == "/notice":
            self._answer(200, "leave") if notice else self._answer(404)
        else:
            self._answer(400)


@pytest.fixture
def metadata(monkeypatch):
    """A metadata server on loopback; its class attributes set when the notice comes."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    _Metadata.quiet, _Metadata.reads, _Metadata.tokens = 0, 0, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv(spot_notices.ENDPOINT_VARIABLE, endpoint)
    yield endpoint
    server.shutdown()


@pytest.mark.parametrize(
    "cloud, said",
    [
        ("aws", "an AWS spot notice (terminate at 2026-11-25T06:00:00Z)"),
        ("gcp", "a Google Compute Engine preemption notice"),
        ("azure", "an Azure Preempt event (not before Wed, 25 Nov 2026 06:00:30 GMT)"),
    ],
)
def test_each_clouds_notice_is_read_in_its_own_protocol(metadata, cloud, said):
    _Metadata.quiet = 1
    assert spot_notices.read_notice(cloud) is None
    assert spot_notices.read_notice(cloud) == said
    if cloud == "aws":
        assert _Metadata.tokens == ["token-1", "token-1"]  # IMDSv2: the GET carries the session token
    url = f"http://{metadata}/notice"
    assert spot_notices.read_notice(url) == f"a preemption notice from {url}"


def test_a_notice_source_that_does_not_answer_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setenv(spot_notices.ENDPOINT_VARIABLE, f"127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(
        UsageError,
        match=r"^--preempt-notice aws: its metadata service did not answer .*;"
        " this machine is not on that cloud",
    ):
        spot_notices.Watcher("aws", lambda reason: None).start()
    with pytest.raises(UsageError, match="^--preempt-notice 'ec2' is not a source of notices; give aws, gcp"):
        spot_notices.check_spec("ec2")


@pytest.mark.timeout(240)
def test_a_spot_notice_makes_train_save_and_exit_75(tmp_path, metadata):
    # The notice comes at the 4th poll (0.2 s apart): mid-run, with no signal at all. The run is long
    # enough (160,000 steps) that no machine finishes it first; the default 8 epochs took under 0.8 s here.
    _Metadata.quiet = 3
    ck = tmp_path / "ck"
    env = clean_env(**{spot_notices.ENDPOINT_VARIABLE: metadata, spot_notices.INTERVAL_VARIABLE: "0.2"})
    result = torchfleet(
        "train",
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--synthetic-size",
        "512",
        "--batch-size",
        "32",
        "--no-progress",
        "--checkpoint-dir",
        str(ck),
        "--preempt-notice",
        "aws",
        "--epochs",
        "10000",
        env=env,
        timeout=80,
    )
    assert result.returncode == PREEMPTED_EXIT, result.stderr
    lines = [x for x in result.stderr.splitlines() if "preempted" in x]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("torchfleet: preempted by an AWS spot notice (terminate at 2026-11-25T06:00:00Z) at step ")
    saved = list_checkpoints(ck)[-1]  # the newest; periodic ones (--checkpoint-every) may be older
    step = int(line.split(" at step ")[1].split(",")[0])
    assert line.endswith(f" at step {step}, checkpoint saved to {saved}, resume with --resume")
    assert saved.name == f"step-{step:08d}"
    verify(saved)


def test_train_refuses_an_unknown_notice_source_before_starting(tmp_path):
    result = torchfleet("train", "--preempt-notice", "ec2", "--checkpoint-dir", str(tmp_path / "ck"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "torchfleet train: error: --preempt-notice 'ec2' is not a source of notices; give aws,"
        " gcp, azure, an http:// URL (polled: an answer of 200 with a body is the"
        " notice), or none"
    )
