"""torchft's lighthouse: started by node 0's launcher or `torchfleet lighthouse`, reached by every group.

The lighthouse is a small gRPC server inside torchft's wheel: every replica
group's Manager sends it a heartbeat every 100 ms and asks it for a quorum
each step. It holds no weights. torchfleet binds it to one address (the job's
interface, never every address) and tunes three of its timings for jobs whose
steps take milliseconds to seconds:

- a group whose heartbeats stop for `HEARTBEAT_TIMEOUT_MS` is dead, and the
  next quorum goes on without it: this is how long survivors pause when a
  machine is lost (torchft's default is 5 s);
- a group that heartbeats but has not asked for the quorum yet (still setting
  up) is waited for up to `JOIN_TIMEOUT_MS`, so it joins the next step instead
  of forcing another reconfiguration soon after (torchft's default, 60 s,
  would hold the survivors a minute for a group that is slow to start);
- at least one group makes a quorum: the job goes on while any group lives.
"""

from __future__ import annotations

import socket

from torchfleet import netif
from torchfleet.errors import UsageError

DEFAULT_PORT = 29510  # torchft_lighthouse's own default
HEARTBEAT_TIMEOUT_MS = 3000
JOIN_TIMEOUT_MS = 10000
REACH_SECONDS = 25.0  # how long a group knocks on the lighthouse before giving up (the job says so within 30 s)


def url(host: str, port: int) -> str:
    return f"http://{_bracketed(host)}:{port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def start(host: str, port: int, min_replicas: int = 1):
    """A lighthouse listening on `host`:`port` only; keep the object alive while the job runs."""
    from torchfleet.replica_groups import torchft_setup

    torchft_setup.quiet()
    from torchft._torchft import LighthouseServer

    if not netif.is_local(host):
        raise UsageError(
            f"the lighthouse is to listen on {host}, which is not an address of this machine;"
            " give this machine's address (node 0 starts it at --master-addr), or run"
            " `torchfleet lighthouse` on the machine it names and pass --lighthouse HOST:PORT"
        )
    _check_port_free(host, port)
    try:
        return LighthouseServer(
            bind=f"{_bracketed(host)}:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=JOIN_TIMEOUT_MS,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        )
    except Exception as exc:  # the Rust server's bind error, as a RuntimeError
        raise UsageError(
            f"the lighthouse cannot listen on {host}:{port} ({str(exc).strip() or type(exc).__name__});"
            " choose another port"
        ) from None


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the server binds (Rust's std sets SO_REUSEADDR): a port whose last connections linger in
        # TIME_WAIT, after a lighthouse that ended, is free for a new one.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UsageError(
                f"the lighthouse's port {port} is already in use on {host} ({exc.strerror});"
                " choose another with --master-port (or --port for torchfleet lighthouse)"
            ) from None


def wait_reachable(host: str, port: int, wait: float = REACH_SECONDS) -> float:
    """Seconds it took the lighthouse at host:port to accept a connection; UsageError after `wait`."""
    try:
        return netif.wait_reachable(host, port, wait, interval=0.5)
    except socket.gaierror as exc:
        raise UsageError(
            f"the lighthouse's host {host!r} cannot be resolved ({exc.strerror}); check --lighthouse (or --master-addr)"
        ) from None
    except OSError as exc:
        raise UsageError(
            f"cannot reach the lighthouse at {host}:{port} within {wait:.0f} s"
            f" ({exc.strerror or exc}); start it first (node 0 starts it at --master-addr"
            " and --master-port, or run `torchfleet lighthouse`) and check --lighthouse,"
            " --master-addr and the firewall"
        ) from None


def serve(host: str, port: int, min_replicas: int = 1) -> int:
    """`torchfleet lighthouse`: run one until interrupted (Ctrl-C or SIGTERM ends it with status 0)."""
    import signal
    import threading

    server = start(host, port, min_replicas)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(
        f"torchfleet: lighthouse listening on {url(host, port)} (at least {min_replicas} group(s) make a"
        f" quorum); give the groups --lighthouse {_bracketed(host)}:{port}",
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.shutdown()
    return 0
