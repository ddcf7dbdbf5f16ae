"""Separate "hosts" on one machine, built from Linux network namespaces, for multi-node tests.

    with hosts(2, bandwidth="100mbit") as net:
        net.run(0, ["ping", "-c", "1", net.addr(1)])
        proc = net.popen(1, [sys.executable, "-m", "torchfleet", ...])

Each host is a network namespace with `lo` up and one interface `eth0` holding 10.77.0.<i+1>/24.
Every `eth0` is one end of a veth pair whose other end sits on a bridge, and the bridge lives in
its own "switch" namespace, so nothing is added to the machine's own network and concurrent users
(several test sessions at once) cannot collide: names carry this process's id and a random token,
and the same addresses may be reused in every switch. `bandwidth` shapes each host's egress with
`tc qdisc ... tbf` (netem is often missing; tbf is in every kernel).

Everything made is removed on exit, on an exception, on Ctrl-C and on SIGTERM: processes started in
a host are killed, then the namespaces (which delete their veths and the bridge) are deleted.
Namespaces left by a process that was killed with SIGKILL are removed by the next use.

The trap this exists to show: the hosts share the machine's host name, which resolves to
127.0.0.1, so Gloo (which advertises the address of the host name unless GLOO_SOCKET_IFNAME is
set) tells its peers to connect to 127.0.0.1 and the ranks never meet.

Needs root and iproute2. Where the machine cannot, `hosts()` skips the calling test with the
reason, or fails it under TORCHFLEET_REQUIRE_SYSTEM_TESTS=1 (helpers.require_system), or raises
`NetnsUnavailable` with `skip=False`, for scripts. Self-contained: standard library only
(helpers, and so pytest, is imported only to skip).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "tfnet"  # every namespace this module makes is called tfnet<pid>x<token>-<role>
SUBNET = "10.77.0"
NETNS_DIR = Path("/var/run/netns")


class NetnsUnavailable(RuntimeError):
    """This machine cannot build namespace hosts; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {out.stderr.strip() or out.returncode}")
    return out


def unavailable_reason() -> str | None:
    """Why namespace hosts cannot be built here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def _kill_namespace_processes(ns: str) -> None:
    out = _ip("netns", "pids", ns, check=False)
    for pid in out.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    _ip("netns", "delete", ns, check=False)


def _remove_stale() -> None:
    """Delete namespaces of ours whose creating process no longer exists (it was SIGKILLed)."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        name = entry.name
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("x", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _delete_namespace(name)


def _tbf(rate: str) -> list[str]:
    """tbf arguments for `rate` ("100mbit", "1gbit"): a burst of about 10 ms of traffic,
    never below 64 KiB, so one timer tick can drain it at high rates."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for suffix, scale in units.items():
        if rate.endswith(suffix) and rate[: -len(suffix)].replace(".", "", 1).isdigit():
            bits = float(rate[: -len(suffix)]) * scale
            break
    else:
        raise ValueError(f"bandwidth {rate!r} is not like '100mbit' or '1gbit'")
    burst = max(int(bits / 8 / 100), 64 * 1024)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]


# Hosts started at once on one busy machine (CI's test parts side by side) can take minutes to import torch: on
# 30 Nov a slow-link host took over 120 s to reach its first steps. The preflight's node 0 waits 60 s for the
# others to report (launcher/preflight.py) and would name a slow starter missing, so the hosts' commands wait
# longer unless a test sets its own wait (test_multinode.py tests that wait itself).
HOSTS_JOIN_SECONDS = "300"


def _patient(kwargs: dict) -> dict:
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    env.setdefault("TORCHFLEET_PREFLIGHT_JOIN_SECONDS", HOSTS_JOIN_SECONDS)
    return {**kwargs, "env": env}


@dataclass
class Network:
    """n hosts on one bridge. Host i is namespace `names[i]` with address `addr(i)`."""

    names: list[str]
    switch: str
    interface: str = "eth0"
    procs: list[subprocess.Popen] = field(default_factory=list)

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command inside host i."""
        return ["ip", "netns", "exec", self.names[i]]

    def run(self, i: int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run inside host i (capture_output and text default to True)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.prefix(i) + list(cmd), **_patient(kwargs))

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """subprocess.Popen inside host i; killed when the network is removed."""
        proc = subprocess.Popen(self.prefix(i) + list(cmd), **_patient(kwargs))
        self.procs.append(proc)
        return proc

    def lose(self, i: int) -> None:
        """SIGKILL every process in host i at once, as when the machine dies: the agent and its
        workers alike (torch's agent starts each worker in a session of its own, so killing the
        agent's process group would leave them running). Its address stays on the bridge."""
        _kill_namespace_processes(self.names[i])

    def remove(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for ns in [*self.names, self.switch]:
            _delete_namespace(ns)


def _build(n: int, bandwidth: str | None) -> Network:
    base = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
    net = Network(names=[f"{base}-h{i}" for i in range(n)], switch=f"{base}-sw")
    try:
        _ip("netns", "add", net.switch)
        _ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(net.names):
            _ip("netns", "add", ns)
            # Interface names need only be unique inside their namespace, so the pair is
            # created straight into the switch and the host: nothing touches the root namespace.
            _ip("-n", net.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", net.interface, "netns", ns)
            _ip("-n", net.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{net.addr(i)}/24", "dev", net.interface)
            _ip("-n", ns, "link", "set", net.interface, "up")
            if bandwidth:
                out = subprocess.run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", net.interface, "root", *_tbf(bandwidth)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                if out.returncode != 0:
                    raise NetnsUnavailable(f"tc tbf failed: {out.stderr.strip()}")
    except BaseException:
        net.remove()
        raise
    return net


@contextlib.contextmanager
def _sigterm_as_exit():
    """Turn SIGTERM into SystemExit while the hosts exist, so `finally` removes them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def hosts(n: int = 2, bandwidth: str | None = None, skip: bool = True):
    """Yield a `Network` of n namespace hosts; remove everything afterwards, whatever happens.

    bandwidth: e.g. "100mbit" or "1gbit" shapes every host's egress with tbf.
    skip: where the machine cannot build them, skip the test (True) or raise NetnsUnavailable.
    """
    reason = unavailable_reason()
    if reason is None and bandwidth and shutil.which("tc") is None:
        reason = "the `tc` command (iproute2) is not installed"
    with _sigterm_as_exit():
        try:
            if reason is not None:
                raise NetnsUnavailable(reason)
            _remove_stale()
            net = _build(n, bandwidth)
        except NetnsUnavailable as exc:
            if not skip:
                raise
            from helpers import require_system  # skips, or fails where CI demands these tests

            require_system(f"cannot build network-namespace hosts: {exc}")
        try:
            yield net
        finally:
            net.remove()
