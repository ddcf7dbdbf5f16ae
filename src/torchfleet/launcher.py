"""Starting processes, always through torchrun's own agent.

`run_command` and `launch` build a `torch.distributed.launcher.LaunchConfig`
from torchrun's knobs and hand it to `elastic_launch`: the agent that
starts, watches and restarts workers is PyTorch's, not ours. What we add is
the choice of rendezvous (loopback and a free port on one machine) and one
readable summary when a rank fails, without any decorator in user code.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as AgentConfig
from torch.distributed.launcher.api import elastic_launch

from torchfleet import failures
from torchfleet.config import LaunchConfig
from torchfleet.errors import UsageError

LOOPBACK = "127.0.0.1"


class LaunchError(RuntimeError):
    """One or more ranks failed; the message is the failure summary."""

    def __init__(self, summary: failures.FailureSummary):
        super().__init__(summary.render())
        self.summary = summary


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def agent_config(cfg: LaunchConfig) -> AgentConfig:
    """torchrun's configuration for `cfg`, as torchrun itself would build it."""
    if cfg.nnodes == 1:
        # One machine: like `torchrun --standalone`, a c10d store on a port the
        # OS picks (no race for a "free" port), reached over loopback only.
        backend, endpoint, local_addr = "c10d", f"{LOOPBACK}:{cfg.master_port or 0}", LOOPBACK
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


def _start(cfg: LaunchConfig, entrypoint: Callable | str, args: list) -> dict[int, Any]:
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
