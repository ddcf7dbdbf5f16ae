"""Starting processes, always through torchrun's own agent.

`run_command` and `launch` build a `torch.distributed.launcher.LaunchConfig`
from torchrun's knobs and hand it to `elastic_launch`: the agent that
starts, watches and restarts workers is PyTorch's, not ours. What we add is
the choice of rendezvous (loopback and a free port on one machine) and one
readable summary when a rank fails, without any decorator in user code.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
import uuid
from typing import Any, Callable

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as AgentConfig
from torch.distributed.launcher.api import elastic_launch

from torchfleet import failures
from torchfleet.config import LaunchConfig
from torchfleet.errors import UsageError

LOOPBACK = "127.0.0.1"
LOOPBACK_RDZV = "torchfleet-loopback"
MASTER_WAIT = 60.0  # seconds a node waits for node 0's rendezvous to answer


class LaunchError(RuntimeError):
    """One or more ranks failed; the message is the failure summary."""

    def __init__(self, summary: failures.FailureSummary):
        super().__init__(summary.render())
        self.summary = summary


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _loopback_store(port: int, timeout: float = 300.0) -> TCPStore:
    """A TCPStore server listening on 127.0.0.1 only.

    TCPStore binds every interface when it creates its own socket; handed a
    socket already bound to loopback (master_listen_fd), it listens there.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(1024)
    return TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, multi_tenant=True,
                    master_listen_fd=sock.detach(), timeout=datetime.timedelta(seconds=timeout),
                    wait_for_workers=False, use_libuv=False)


def _loopback_handler(params):
    """torchrun's c10d rendezvous, with both of its stores bound to loopback (one machine)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks it against the requested backend
            return LOOPBACK_RDZV

    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = _loopback_store(port)
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The store the workers join (MASTER_ADDR:MASTER_PORT) is a second server the handler makes.
    handler._create_tcp_store_server = lambda addr, port: _loopback_store(port)
    return handler


def _register_loopback() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_RDZV, _loopback_handler)


def check_port_free(host: str, port: int) -> None:
    """UsageError when `port` is taken, before any process starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UsageError(f"--master-port {port} is already in use on {host} ({exc.strerror}); choose another"
                             " port, or leave --master-port out on one machine for a free one") from None


def wait_for_master(addr: str, port: int, wait: float = MASTER_WAIT) -> None:
    """UsageError when node 0's rendezvous at addr:port cannot be reached within `wait` seconds."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"--master-addr {addr!r} cannot be resolved ({exc.strerror}); give node 0's host name or IP address") from None
    deadline = time.monotonic() + wait
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, max(0.1, wait))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise UsageError(f"cannot reach the master at {addr}:{port} within {wait:.0f} s ({exc.strerror or exc});"
                                 " check --master-addr and --master-port, and that node 0 has started") from None
        time.sleep(1.0)


def exposure(cfg: LaunchConfig) -> str:
    """The sentence a multi-machine run prints: what it opens to the network."""
    port = cfg.master_port or 29500
    if cfg.node_rank == 0:
        return (f"torchfleet: node 0 exposes the rendezvous store on every interface, port {port} (TCP, no"
                f" authentication), and Gloo/NCCL ports chosen by the OS; anyone who reaches them can join or"
                f" disturb the job: run it on a private network (docs/security.md)")
    return f"torchfleet: node {cfg.node_rank} joins the rendezvous at {cfg.master_addr}:{port} (docs/security.md)"


def agent_config(cfg: LaunchConfig) -> AgentConfig:
    """torchrun's configuration for `cfg`, as torchrun itself would build it."""
    if cfg.nnodes == 1:
        # One machine: like `torchrun --standalone`, a c10d store on a port the
        # OS picks (no race for a "free" port), bound to and reached over loopback only.
        backend, endpoint, local_addr = LOOPBACK_RDZV, f"{LOOPBACK}:{cfg.master_port or 0}", LOOPBACK
        rdzv_configs: dict[str, Any] = {}
    else:
        # Many machines: torchrun's static rendezvous at the master's address.
        backend = "static"
        endpoint = f"{cfg.master_addr}:{cfg.master_port or 29500}"
        rdzv_configs = {"rank": cfg.node_rank}
        local_addr = None
    return AgentConfig(
        min_nodes=cfg.nnodes,
        max_nodes=cfg.nnodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=os.environ.get("TORCHFLEET_RUN_ID", uuid.uuid4().hex[:12]),
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=cfg.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(),
    )


def _quiet_agent_logs() -> None:
    # The agent logs every failure and every SIGTERM it sends; the summary
    # below says the same once, so keep its chatter to real agent errors.
    if not os.environ.get("TORCHFLEET_VERBOSE"):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


def _worker_threads(cfg: LaunchConfig) -> None:
    # As torchrun does: several processes on one host each get one intra-op
    # thread unless the user chose, or they fight over the same cores.
    if cfg.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if cfg.nnodes == 1 and _has_interface("lo"):
        # One machine: Gloo's pairs listen on loopback too, not on the host's public address.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _has_interface(name: str) -> bool:
    try:
        socket.if_nametoindex(name)
        return True
    except OSError:
        return False


def _preflight(cfg: LaunchConfig) -> None:
    """Refuse what would only fail later, slowly: a busy port, an unreachable master."""
    if cfg.nnodes == 1:
        if cfg.master_port:
            check_port_free(LOOPBACK, cfg.master_port)
        return
    if cfg.node_rank == 0:
        check_port_free("0.0.0.0", cfg.master_port or 29500)
    else:
        wait_for_master(cfg.master_addr, cfg.master_port or 29500)
    print(exposure(cfg), file=sys.stderr, flush=True)


def _start(cfg: LaunchConfig, entrypoint: Callable | str, args: list) -> dict[int, Any]:
    _preflight(cfg)
    _register_loopback()
    _quiet_agent_logs()
    _worker_threads(cfg)
    try:
        return elastic_launch(agent_config(cfg), entrypoint)(*args)
    except ChildFailedError as exc:
        raise LaunchError(failures.summarize(exc)) from None


def run_command(cfg: LaunchConfig, argv: list[str]) -> int:
    """Run `python argv...` on every rank; return the exit status for the shell."""
    try:
        _start(cfg, sys.executable, ["-u", *argv])
    except LaunchError as exc:
        return failures.report(exc.summary)
    return 0


def run_script(cfg: LaunchConfig, script: str, script_args: list[str]) -> int:
    """`torchfleet run script.py args`: the script runs as __main__ on every rank."""
    if not os.path.isfile(script):
        raise UsageError(f"script {script!r} does not exist; give the path to a Python file")
    if not script.endswith(".py"):
        raise UsageError(f"script {script!r} is not a Python file (.py)")
    return run_command(cfg, ["-m", "torchfleet._bootstrap", script, *script_args])


def launch(fn: Callable, nprocs: int = 2, args: tuple = (), max_restarts: int = 0) -> list[Any]:
    """Run ``fn(*args)`` in `nprocs` processes on this machine; return each rank's result.

    `fn` must be importable by a fresh interpreter (defined in a module, not
    in ``__main__`` of a notebook: see `notebook_launch` for that). On a
    failure this raises `LaunchError`, whose message names the first failing
    rank and holds its traceback.
    """
    if nprocs < 1:
        raise UsageError(f"nprocs {nprocs} must be at least 1")
    cfg = LaunchConfig(nproc_per_node=nprocs, max_restarts=max_restarts)
    results = _start(cfg, failures.Recorded(fn), list(args))
    return [results[rank] for rank in sorted(results)]
