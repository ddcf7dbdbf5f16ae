"""Checks before a multi-machine job: find in seconds what would otherwise hang for minutes.

Run once on every machine (automatically by `torchfleet run/train --nnodes N`,
or by `torchfleet doctor --master-addr A --master-port P --nnodes N --node-rank R`):

1. the interface that routes to the master exists (else: "interface has no route");
2. the master's port answers (else: refused once node 0's wait is over, timed out or unreachable
   within a few seconds);
3. every machine reports its torch and torchfleet versions and backend to
   node 0 through a TCPStore on the master port, and node 0 compares them;
4. a small all-reduce on a Gloo group over the chosen interface completes,
   which is exactly what fails when Gloo advertises 127.0.0.1; its bandwidth
   is reported.

A failure raises `PreflightError`: one sentence naming the node and the cause
(a UsageError: the CLI shows it with exit status 2). Node 0's store is handed
back and must stay open until the job ends: torchrun's static rendezvous opens
its store on the same port with `multi_tenant=True`, so it reuses this server
and no other machine ever sees the port closed between the checks and the job.

Node 0 waits JOIN_SECONDS for every machine to report, and the others knock as long on
a master port that refuses them (node 0 still starting: a scheduler starts every machine
at once, and node 0 may be the last to import torch); no answer at all fails in seconds.
`TORCHFLEET_PREFLIGHT_JOIN_SECONDS` sets another wait, for machines that start minutes
apart (a scheduler that starts them one by one, a busy machine importing torch).

For testing, `TORCHFLEET_PREFLIGHT_TORCH_VERSION` and
`TORCHFLEET_PREFLIGHT_TORCHFLEET_VERSION` replace the versions this machine
reports, so a mismatch can be simulated without installing another torch.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from torchfleet import installed, netif
from torchfleet.errors import UsageError

CONNECT_SECONDS = 4.0  # how long a node keeps knocking on a master port that does not refuse it (no route)
# How long node 0 waits for every node to report: machines started by hand a little
# apart must still meet; a wrong address fails on the other side within seconds.
JOIN_SECONDS = 60.0
JOIN_SECONDS_VAR = "TORCHFLEET_PREFLIGHT_JOIN_SECONDS"
ALLREDUCE_BYTES = 4 * 2**20
_KEY = "torchfleet/preflight/"


class PreflightError(UsageError):
    """A check failed; the message is one sentence naming the node and the cause."""


@dataclass(frozen=True)
class Facts:
    """What one machine reports; every field but host and address must agree."""

    node: int
    host: str
    address: str
    torch: str
    torchfleet: str
    backend: str


def _versions() -> tuple[str, str]:
    import torch

    return (
        os.environ.get("TORCHFLEET_PREFLIGHT_TORCH_VERSION", torch.__version__),
        os.environ.get("TORCHFLEET_PREFLIGHT_TORCHFLEET_VERSION", installed.version()),
    )


def local_facts(node: int, address: str) -> Facts:
    from torchfleet.backend import choose_backend, probe_hardware

    torch_version, fleet_version = _versions()
    return Facts(
        node=node,
        host=socket.gethostname(),
        address=address,
        torch=torch_version,
        torchfleet=fleet_version,
        backend=choose_backend(probe_hardware())[0],
    )


def label(node: int | None, address: str | None) -> str:
    # None: an elastic (c10d) machine, whose node rank the rendezvous assigns only after these checks.
    return ("this machine" if node is None else f"node {node}") + (f" ({address})" if address else "")


def route(node: int | None, master: str) -> netif.Interface:
    """The interface this machine reaches the master through, or PreflightError."""
    try:
        socket.getaddrinfo(master, None)
    except socket.gaierror as exc:
        raise PreflightError(
            f"{label(node, None)}: --master-addr {master!r} cannot be resolved ({exc.strerror});"
            " give node 0's host name or IP address"
        ) from None
    iface = netif.interface_for(master)
    if iface is None:
        raise PreflightError(
            f"{label(node, None)}: interface has no route to the master "
            f"{master}; check --master-addr and this machine's network"
        )
    return iface


def route_env(node: int | None, master: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the interface to `master`, where unset."""
    iface = route(node, master)
    wanted = {"GLOO_SOCKET_IFNAME": iface.name, "NCCL_SOCKET_IFNAME": iface.name}
    return {k: v for k, v in wanted.items() if not os.environ.get(k)}


def check_master_is_here(master: str, nnodes: int) -> None:
    """On node 0: the master address must be this machine's, and not loopback if others come."""
    found = netif.addresses_of(master)
    if not found:
        raise PreflightError(
            f"node 0: the master address {master!r} does not resolve;"
            " give --master-addr as an IP address of this machine"
        )
    mine = {a for i in netif.list_interfaces() for a in i.addresses}
    loop = all(netif.is_loopback(a) for a in found)
    if loop and nnodes > 1:
        raise PreflightError(
            f"node 0: the master address {master!r} is loopback ({found[0]}), which"
            " the other machines cannot reach; give this machine's own address"
        )
    if not loop and not mine.intersection(found):
        raise PreflightError(
            f"node 0: the master address {master} is not an address of this"
            f" machine ({', '.join(sorted(mine)) or 'none'}); run node 0 on the"
            " machine that has it, or fix --master-addr"
        )


def knock(
    node: int | None, address: str, master: str, port: int, seconds: float = CONNECT_SECONDS, starting: float = 0.0
) -> float:
    """Connect to master:port; seconds it took. A refused connection is retried for `starting` seconds (at least
    `seconds`): node 0 may still be starting, as when a scheduler starts every machine at once and node 0 imports
    torch last. No answer fails at once, and an unreachable host after `seconds`: a wrong address or a firewall."""
    start = time.monotonic()
    quick, patient = start + seconds, start + max(seconds, starting)
    while True:
        try:
            with socket.create_connection((master, port), timeout=max(1.0, quick - time.monotonic())):
                return time.monotonic() - start
        except ConnectionRefusedError:
            cause = "was refused (nothing listens there: is node 0 started, and is the port right?)"
            deadline = patient
        except socket.timeout:
            cause = "timed out (no answer: a wrong address or a firewall)"
            break
        except OSError as exc:
            if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                cause = f"failed: {os.strerror(exc.errno).lower()} (is --master-addr right?)"
            else:
                cause = f"failed: {exc.strerror or exc}"
            deadline = quick
        if time.monotonic() >= deadline:
            break
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    raise PreflightError(
        f"{label(node, address)}: connection to the master {master}:{port} "
        f"{cause}, after {time.monotonic() - start:.0f} s"
    )


def _open_store(node: int, address: str, master: str, port: int, seconds: float):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=seconds)
    try:
        # multi_tenant: torchrun's static rendezvous will reuse this server (see module doc).
        return dist.TCPStore(
            master, port, is_master=node == 0, multi_tenant=True, wait_for_workers=False, timeout=timeout
        )
    except (RuntimeError, OSError) as exc:
        what = "could not open the master port" if node == 0 else "could not join the master's store"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PreflightError(f"{label(node, address)}: {what} {master}:{port} ({first})") from None


def _compare(mine: Facts, theirs: Facts) -> str | None:
    """The first way node `theirs` differs from node 0 (`mine`), as a sentence; None if none."""
    fixes = {
        "torch": ("torch version", "install the same torch on every machine"),
        "torchfleet": ("torchfleet version", "install the same torchfleet on every machine"),
        "backend": ("backend", "every machine must use the same backend"),
    }
    for field, (what, fix) in fixes.items():
        a, b = getattr(theirs, field), getattr(mine, field)
        if a != b:
            return f"{label(theirs.node, theirs.address)}: {what} {a} vs {b} on node 0 ({mine.address}); {fix}"
    return None


def join_seconds() -> float:
    """How long node 0 waits for every node to report: JOIN_SECONDS, or TORCHFLEET_PREFLIGHT_JOIN_SECONDS."""
    raw = os.environ.get(JOIN_SECONDS_VAR)
    if raw is None:
        return JOIN_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise UsageError(
            f"{JOIN_SECONDS_VAR}={raw!r} is not a number of seconds above 0 (the default is {JOIN_SECONDS:.0f})"
        )
    return seconds


def _exchange(store, facts: Facts, nnodes: int, join: float) -> list[Facts]:
    """Every node's facts, compared on node 0; the verdict is shared through the store."""
    store.set(f"{_KEY}node/{facts.node}", json.dumps(asdict(facts)))
    verdict_key = f"{_KEY}verdict"
    if facts.node == 0:
        keys = [f"{_KEY}node/{n}" for n in range(nnodes)]
        try:
            store.wait(keys, datetime.timedelta(seconds=join))
        except RuntimeError:  # torch raises DistStoreError (a RuntimeError) on timeout
            missing = [str(n) for n, k in enumerate(keys) if not store.check([k])]
            problem = (
                f"node 0 ({facts.address}): node {', '.join(missing)} did not report within"
                f" {join:.0f} s; start it with --node-rank {missing[0]}"
                f" --nnodes {nnodes} and the same --master-addr/--master-port"
            )
            store.set(verdict_key, json.dumps({"problems": [problem]}))
            _wait_acks(store, facts.node, [int(n) for n in range(1, nnodes) if str(n) not in missing])
            raise PreflightError(problem) from None
        every = [Facts(**json.loads(store.get(k))) for k in keys]
        problems = [p for p in (_compare(facts, f) for f in every[1:]) if p]
        store.set(verdict_key, json.dumps({"problems": problems, "nodes": [asdict(f) for f in every]}))
        if problems:
            _wait_acks(store, 0, list(range(1, nnodes)))
    else:
        try:
            store.wait([verdict_key], datetime.timedelta(seconds=join + CONNECT_SECONDS))
            verdict = json.loads(store.get(verdict_key))
            store.set(f"{_KEY}ack/{facts.node}", "1")
        except RuntimeError as exc:  # DistNetworkError, DistStoreError: node 0 went away or never answered
            raise PreflightError(
                f"{label(facts.node, facts.address)}: node 0 gave no verdict on the"
                f" versions ({str(exc).splitlines()[0][:120]}); see node 0's output"
            ) from None
        problems, every = verdict["problems"], [Facts(**f) for f in verdict.get("nodes", [])]
    if problems:
        # Name this node's own problem when it has one, else the first found.
        tag = f"node {facts.node} "
        raise PreflightError(next((p for p in problems if p.startswith(tag)), problems[0]))
    return every


def _wait_acks(store, node: int, others: list[int]) -> None:
    """Keep node 0's store open until the others have read a failing verdict (at most 3 s)."""
    try:
        store.wait([f"{_KEY}ack/{n}" for n in others], datetime.timedelta(seconds=3))
    except RuntimeError:
        pass  # a node that went away cannot be told; its own checks fail on their own


def _all_reduce(store, facts: Facts, nnodes: int, iface: str) -> float:
    """Time a Gloo all-reduce of ALLREDUCE_BYTES across the nodes; returns seconds."""
    import torch
    import torch.distributed as dist

    group_store = dist.PrefixStore(f"{_KEY}gloo", store)
    try:
        group = dist.ProcessGroupGloo(group_store, facts.node, nnodes, datetime.timedelta(seconds=10))
        warm = torch.ones(8)
        group.allreduce([warm]).wait()  # pyright: ignore[reportAttributeAccessIssue] (torch's Backend stub omits allreduce)
        data = torch.full((ALLREDUCE_BYTES // 4,), float(facts.node + 1))
        start = time.perf_counter()
        group.allreduce([data]).wait()  # pyright: ignore[reportAttributeAccessIssue] (as above)
        seconds = time.perf_counter() - start
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:160]
        raise PreflightError(
            f"{label(facts.node, facts.address)}: the test all-reduce over interface {iface} failed ({first})"
        ) from None
    expected = nnodes * (nnodes + 1) / 2
    if warm[0].item() != nnodes or data[0].item() != expected:
        raise PreflightError(
            f"{label(facts.node, facts.address)}: the test all-reduce gave {data[0].item()} instead of {expected}"
        )
    return seconds


@dataclass
class Outcome:
    """What passed, for the report; `store` is node 0's server (keep it until the job ends)."""

    interface: str
    address: str
    nodes: list[Facts]
    allreduce_s: float | None
    store: object | None = None

    def sentence(self, node: int | None) -> str:
        first = self.nodes[0] if self.nodes else None
        if first is not None and len(self.nodes) > 1:
            agree = (
                f"torch {first.torch}, torchfleet {first.torchfleet} and {first.backend} on all {len(self.nodes)} nodes"
            )
        else:
            agree = "the master port opens here" if first else "the master port answers"
        text = f"preflight ok on {label(node, self.address)} via {self.interface}: {agree}"
        if self.allreduce_s:
            # Bus bandwidth of a ring all-reduce: each byte crosses the link 2(n-1)/n times.
            n = len(self.nodes)
            bus = ALLREDUCE_BYTES * 2 * (n - 1) / n / self.allreduce_s
            text += (
                f"; all-reduce of {ALLREDUCE_BYTES // 2**20} MiB in"
                f" {self.allreduce_s * 1e3:.1f} ms ({bus * 8 / 1e6:.0f} Mbit/s)"
            )
        return text


def run(master: str, port: int, node: int, nnodes: int) -> Outcome:
    """All checks for one machine of a static job; PreflightError on the first failure."""
    join = join_seconds()
    iface = route(node, master)
    address = netif.source_address(master) or "?"
    if node == 0:
        check_master_is_here(master, nnodes)
    else:
        knock(node, address, master, port, starting=join)  # node 0 may start last: it has as long as they wait
    store = _open_store(node, address, master, port, join + CONNECT_SECONDS)
    facts = local_facts(node, address)
    if nnodes == 1:
        return Outcome(iface.name, address, [facts], None, store)
    every = _exchange(store, facts, nnodes, join)
    seconds = _all_reduce(store, facts, nnodes, iface.name)
    return Outcome(iface.name, address, every, seconds, store if node == 0 else None)


def reach(node: int | None, host: str, port: int) -> Outcome:
    """The checks an elastic (c10d) machine can make alone: a route and an answering port. A refused port is
    knocked on for the join wait, as in `run`: the rendezvous host may be the last machine to start listening."""
    iface = route(node, host)
    address = netif.source_address(host) or "?"
    if not netif.is_local(host):
        knock(node, address, host, port, starting=join_seconds())
    return Outcome(iface.name, address, [], None)
