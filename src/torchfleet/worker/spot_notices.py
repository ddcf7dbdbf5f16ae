"""Spot and preemptible machines: the cloud's notice that it is taking the machine back.

Some clouds say so in the instance's metadata before any signal arrives: AWS
posts spot/instance-action two minutes ahead, Google Compute Engine flips
instance/preempted to TRUE about 30 s ahead, Azure lists a Preempt event in
its scheduled events. `--preempt-notice aws|gcp|azure|URL` has one process per
machine poll that every few seconds (AWS's advice is every 5 s) from a daemon
thread, and a notice sets the same flag a SIGTERM would (preemption.Listener):
the ranks agree, save once and leave.

The first poll happens before training, so a machine with no such service
(the flag given on the wrong cloud) is refused in one sentence instead of
being watched in vain. TORCHFLEET_METADATA_ENDPOINT (host:port) points the
three clouds' addresses elsewhere, as for a proxy or a test's own server.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from torchfleet.errors import UsageError

INTERVAL_VARIABLE = "TORCHFLEET_NOTICE_INTERVAL"
ENDPOINT_VARIABLE = "TORCHFLEET_METADATA_ENDPOINT"
DEFAULT_INTERVAL = 5.0
# A metadata service answers in milliseconds; one that does not in this long is not there (the margin is
# for a loaded machine: the first poll is made while the job starts).
_TIMEOUT = 5.0


@dataclass(frozen=True)
class Cloud:
    host: str  # host[:port] of its metadata service
    path: str
    headers: tuple[tuple[str, str], ...] = ()


CLOUDS = {
    # IMDSv2: a session token first (PUT), then the notice; 404 until there is one.
    "aws": Cloud("169.254.169.254", "/latest/meta-data/spot/instance-action"),
    "gcp": Cloud(
        "metadata.google.internal", "/computeMetadata/v1/instance/preempted", (("Metadata-Flavor", "Google"),)
    ),
    "azure": Cloud("169.254.169.254", "/metadata/scheduledevents?api-version=2020-07-01", (("Metadata", "true"),)),
}


def check_spec(spec: str) -> str:
    """`spec` if it names a cloud, a URL or none; a UsageError saying what is accepted otherwise."""
    if spec in (*CLOUDS, "none") or spec.startswith(("http://", "https://")):
        return spec
    raise UsageError(
        f"--preempt-notice {spec!r} is not a source of notices; give aws, gcp, azure, an http:// URL"
        " (polled: an answer of 200 with a body is the notice), or none"
    )


def _interval() -> float:
    text = os.environ.get(INTERVAL_VARIABLE, "")
    try:
        value = float(text) if text else DEFAULT_INTERVAL
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{INTERVAL_VARIABLE}={text!r} must be a positive number of seconds")
    return value


def _get(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT) as answer:
            return answer.status, answer.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:  # 404: no notice yet, which AWS and a plain URL answer
        return exc.code, ""


def _base(cloud: Cloud) -> str:
    return f"http://{os.environ.get(ENDPOINT_VARIABLE) or cloud.host}"


def read_notice(spec: str) -> str | None:
    """One poll: a sentence describing the notice, or None when there is none. Raises OSError when the
    service cannot be reached."""
    if spec.startswith(("http://", "https://")):
        status, body = _get(spec, {})
        return f"a preemption notice from {spec}" if status == 200 and body.strip() else None
    cloud = CLOUDS[spec]
    headers = dict(cloud.headers)
    if spec == "aws":
        status, token = _get(
            f"{_base(cloud)}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, method="PUT"
        )
        if status == 200:  # IMDSv1-only instances refuse the PUT; the GET then goes without a token
            headers["X-aws-ec2-metadata-token"] = token
    status, body = _get(_base(cloud) + cloud.path, headers)
    if status != 200:
        return None
    if spec == "aws":
        action = json.loads(body) if body.strip() else {}
        return f"an AWS spot notice ({action.get('action', 'stop')} at {action.get('time', '?')})"
    if spec == "gcp":
        return "a Google Compute Engine preemption notice" if body.strip().upper() == "TRUE" else None
    events = json.loads(body).get("Events", []) if body.strip() else []
    preempts = [e for e in events if e.get("EventType") == "Preempt"]
    return f"an Azure Preempt event (not before {preempts[0].get('NotBefore', '?')})" if preempts else None


class Watcher:
    """Polls `spec` every few seconds on a daemon thread and calls `told(sentence)` once on a notice."""

    def __init__(self, spec: str, told: Callable[[str], None]):
        self.spec = check_spec(spec)
        self.told = told
        self.interval = _interval()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchfleet-preempt-notice", daemon=True)

    def start(self) -> Watcher:
        try:
            found = read_notice(self.spec)
        except (OSError, ValueError) as exc:  # unreachable, or an answer that is not the service's
            reason = getattr(exc, "reason", exc)
            raise UsageError(
                f"--preempt-notice {self.spec}: its metadata service did not answer ({reason});"
                " this machine is not on that cloud, or the service is off; give another source"
                " or none"
            ) from None
        if found:
            self.told(found)
        else:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                found = read_notice(self.spec)
            except (OSError, ValueError):
                continue  # a missed poll; the next may answer, and a reclaim still sends SIGTERM
            if found:
                self.told(found)
                return

    def stop(self) -> None:
        self._stop.set()
