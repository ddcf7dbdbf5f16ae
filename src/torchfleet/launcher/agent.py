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
import pickle
import socket
import sys
import time
import uuid
from typing import Any, Callable

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig as AgentConfig
from torch.distributed.launcher.api import elastic_launch

from torchfleet import netif
from torchfleet.config import LaunchConfig
from torchfleet.env.name_lookup import absorb_failed_lookup_warning
from torchfleet.errors import UsageError
from torchfleet.launcher import (
    failures,
    forked,
    groups,
    preempt_relay,
    preflight,
    rendezvous,
    torchrun_flags,
)
from torchfleet.launcher.environ import exported

LOOPBACK = "127.0.0.1"
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


def check_port_free(host: str, port: int, endpoint: str | None = None) -> None:
    """UsageError when `port` is taken, before any process starts (`endpoint`: the
    --rdzv-endpoint that names it, where that flag chose the port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            if endpoint:
                raise UsageError(f"--rdzv-endpoint {endpoint}: port {port} is already in use on this machine"
                                 f" ({exc.strerror}); choose another port") from None
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
    # The store listens where the rendezvous says: the c10d endpoint (--rdzv-endpoint,
    # on whichever machine it names), else the master's port on node 0.
    host, port = cfg.endpoint
    hosts_store = netif.is_local(host) if cfg.elastic else cfg.node_rank == 0
    who = "this machine" if cfg.elastic else f"node {cfg.node_rank}"
    if hosts_store:
        return (f"torchfleet: {who} exposes the rendezvous store on every interface, port {port} (TCP, no"
                f" authentication), and Gloo/NCCL ports chosen by the OS; anyone who reaches them can join or"
                f" disturb the job: run it on a private network (docs/guides/security.md)")
    return f"torchfleet: {who} joins the rendezvous at {host}:{port} (docs/guides/security.md)"


def agent_config(cfg: LaunchConfig, overrides: dict[str, Any] | None = None,
                 start_method: str = "spawn") -> AgentConfig:
    """torchrun's configuration for `cfg`, as torchrun itself would build it (`start_method`: a function
    entrypoint's; a command's workers are always new processes)."""
    run_id = cfg.rdzv_id or os.environ.get("TORCHFLEET_RUN_ID")
    if not cfg.multi_node:
        # One machine: like `torchrun --standalone`, a c10d rendezvous on a port
        # the OS picks, but its stores listen on loopback only (see rendezvous.py).
        backend, endpoint, local_addr = rendezvous.register(), f"{LOOPBACK}:{cfg.master_port or 0}", LOOPBACK
        rdzv_configs: dict[str, Any] = {}
        run_id = run_id or uuid.uuid4().hex[:12]
    elif cfg.elastic:
        host, port = cfg.endpoint
        # torch's c10d, re-reading where the workers' store is each round (rendezvous.py).
        backend, endpoint = rendezvous.register_elastic(), f"{host}:{port}"
        # torch decides who hosts the store by comparing the endpoint with the
        # host name's address; where the host name resolves to 127.0.0.1 no
        # machine would host it. Whether the endpoint is one of ours is exact.
        rdzv_configs = {"is_host": netif.is_local(host)}
        # The node that becomes rank 0 advertises local_addr as the workers'
        # MASTER_ADDR; torch's default, the FQDN, may resolve to 127.0.0.1.
        local_addr = netif.source_address(host)
        run_id = run_id or "torchfleet"  # must be the same on every machine
    else:
        # Many machines: torchrun's static rendezvous at the master's address.
        backend = "static"
        endpoint = f"{cfg.master_addr}:{cfg.master_port or 29500}"
        rdzv_configs = {"rank": cfg.node_rank}
        local_addr = netif.source_address(cfg.master_addr)
        run_id = run_id or "torchfleet"
    fields: dict[str, Any] = dict(
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=run_id,
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=cfg.max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(),
    )
    # torchrun flags torchfleet does not handle itself, as torchrun would apply them.
    overrides = dict(overrides or {})
    if "rdzv_configs" in overrides:
        # --rdzv-conf adds to the rendezvous options above instead of replacing them: replaced,
        # the c10d host lost `is_host` and, as its host name resolves to 127.0.0.1 on many
        # machines, nobody hosted the store and every node timed out connecting to it. "rank"
        # is torchrun's own parse of its --node-rank, which torchfleet reads itself (it is 0
        # there on every node), so the static rendezvous keeps ours.
        theirs = {k: v for k, v in overrides.pop("rdzv_configs").items() if k != "rank"}
        fields["rdzv_configs"] = {**rdzv_configs, **theirs}
    return AgentConfig(**{**fields, **overrides})


def socket_env(cfg: LaunchConfig) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for the workers, where the user set none.

    Without them Gloo advertises the address the host name resolves to, often
    127.0.0.1, and ranks on other machines never connect. Many machines: the
    interface that routes to the master. One machine: loopback, so nothing
    listens on the network.
    """
    if cfg.multi_node:
        return preflight.route_env(_node(cfg), cfg.endpoint[0])
    else:
        lo = next((i.name for i in netif.list_interfaces() if i.is_loopback), None)
        wanted = {"GLOO_SOCKET_IFNAME": lo} if lo else {}
    return {k: v for k, v in wanted.items() if not os.environ.get(k)}


def _node(cfg: LaunchConfig) -> int | None:
    """This machine's node rank for messages; None where the c10d rendezvous assigns it later
    (every elastic machine would otherwise call itself node 0)."""
    return None if cfg.elastic else cfg.node_rank


def check_nodes(cfg: LaunchConfig) -> preflight.Outcome:
    """The preflight for this machine of a multi-machine job (see preflight.py)."""
    if cfg.elastic:
        host, port = cfg.endpoint
        return preflight.reach(None, host, port)
    return preflight.run(cfg.master_addr, cfg.master_port or 29500, cfg.node_rank, cfg.max_nodes)


def _quiet_agent_logs() -> None:
    # The agent logs every failure and every SIGTERM it sends; the summary
    # below says the same once, so keep its chatter to real agent errors.
    if not os.environ.get("TORCHFLEET_VERBOSE"):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        # This one has a level of its own: its "Received 15 death signal, shutting down workers" is said
        # by the launcher's own line after a preemption signal (preempt_relay.report).
        logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
        # Function workers (launch(), train's forked ones) are stopped through torch.multiprocessing, which
        # warns of each SIGTERM it sends after a rank failed: the summary names the rank that failed.
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def worker_env(cfg: LaunchConfig) -> dict[str, str]:
    """What the agent's environment gets for its workers (and gives back after the run)."""
    chosen = socket_env(cfg)
    # As torchrun does: several processes on one host each get one intra-op
    # thread unless the user chose, or they fight over the same cores.
    if cfg.nproc_per_node > 1 and not os.environ.get("OMP_NUM_THREADS"):
        chosen["OMP_NUM_THREADS"] = "1"
    return chosen


def _preflight(cfg: LaunchConfig) -> None:
    """Refuse what would only fail later, slowly: a busy port, an unreachable master."""
    if not cfg.multi_node:
        if cfg.master_port:
            check_port_free(LOOPBACK, cfg.master_port)
        return
    if cfg.elastic:
        # Not node_rank, which is 0 on every elastic machine until the rendezvous assigns it: that
        # had each machine check the master port (29500), which the job never opens. The store
        # opens on the endpoint's port, on the machine the endpoint names.
        host, port = cfg.endpoint
        if netif.is_local(host):
            check_port_free("0.0.0.0", port, endpoint=f"{host}:{port}")
        return
    if cfg.node_rank == 0:
        check_port_free("0.0.0.0", cfg.master_port or 29500)
    elif not cfg.preflight:
        # Without the preflight's checks, still refuse to wait forever on a master nobody answers at.
        wait_for_master(cfg.master_addr, cfg.master_port or 29500)


def _start(cfg: LaunchConfig, entrypoint: Callable | str, args: list,
           overrides: dict[str, Any] | None = None) -> dict[int, Any]:
    # Before the first of the launcher's c10d sockets (the checks', the rendezvous', a replica group's).
    absorb_failed_lookup_warning(netif.source_address(cfg.endpoint[0] if cfg.elastic else cfg.master_addr))
    group = None
    if cfg.replica_groups:
        # One replica group per machine (groups.py): this machine's agent, the lighthouse checked or started.
        group = groups.prepare(cfg)
        print(f"torchfleet: {group.sentence}", flush=True)
        print(group.exposure, file=sys.stderr, flush=True)
        cfg = group.agent
    _preflight(cfg)
    _quiet_agent_logs()
    # A function's workers fork from a server (forked.py), started before the variables below are exported.
    start_method = forked.start_method() if isinstance(entrypoint, failures.Recorded) else "spawn"
    chosen = {**worker_env(cfg), **(group.env if group else {})}
    checked = None
    # The workers inherit the agent's environment; `launch` callers get theirs back after.
    with exported(chosen):
        try:
            if cfg.multi_node and cfg.preflight:
                checked = check_nodes(cfg)
                print(f"torchfleet: {checked.sentence(_node(cfg))}", flush=True)
            if cfg.multi_node:
                print(exposure(cfg), file=sys.stderr, flush=True)  # once the checks have passed
            if isinstance(entrypoint, failures.Recorded) and start_method == forked.START_METHOD:
                entrypoint.environ = dict(os.environ)  # what a spawned worker would inherit now
            # torchrun's launch_agent builds its agent from this module global: ours for the call (see _Agent).
            launcher_api.LocalElasticAgent = _Agent
            return elastic_launch(agent_config(cfg, overrides, start_method), entrypoint)(*args)
        except ChildFailedError as exc:
            raise LaunchError(failures.summarize(exc)) from None
        finally:
            launcher_api.LocalElasticAgent = LocalElasticAgent
            del checked  # node 0's store served the rendezvous too; now it may close
            if group is not None and group.server is not None:
                group.server.shutdown()  # node 0's lighthouse: the job has ended here


class _Agent(LocalElasticAgent):
    """torchrun's agent, but a worker that left with PREEMPTED_EXIT (told to leave, it saved) ends the
    group instead of having it restarted under --max-restarts: the cluster asked for the machine back,
    and a restart here would start training again on it. (A signal to the launcher stops the agent
    itself; this is for a signal that reached only the workers, as Slurm's or a node handler's can.)"""

    def _monitor_workers(self, worker_group):
        # torch's @prof decorator hides the method's parameters from the type checker.
        result = super()._monitor_workers(worker_group)  # pyright: ignore[reportCallIssue]
        if result.state == WorkerState.FAILED:
            self._add_the_other_failures(worker_group, result.failures)
            if any(f.exitcode == failures.PREEMPTED_EXIT for f in result.failures.values()):
                self._remaining_restarts = 0
        return result

    def _add_the_other_failures(self, worker_group, found: dict) -> None:
        """Function workers (forked or spawned by multiprocessing: launch(), train) are watched by torch's
        MultiprocessContext, which reports one failed rank: the first its poll finds, not the first to fail.
        Under load a rank that died of its peer's crash (a closed connection) is often found first, and the
        crash itself, or the hang watchdog's verdict, was lost. Every rank that also failed and wrote its error
        file is added here, so that failures.summarize can put the cause first, as it does for spawned ones."""
        pcontext = getattr(self, "_pcontext", None)
        processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
        if not isinstance(pcontext, MultiprocessContext) or not processes:
            return
        known = {failure.local_rank for failure in found.values()}
        for local_rank, process in enumerate(processes):
            path = pcontext.error_files.get(local_rank)
            if local_rank in known or process.exitcode in (0, None) or not path or not os.path.isfile(path):
                continue
            found[worker_group.workers[local_rank].global_rank] = ProcessFailure(
                local_rank=local_rank, pid=process.pid, exitcode=process.exitcode, error_file=path)


def run_command(cfg: LaunchConfig, argv: list[str], program: str | None = None,
                overrides: dict[str, Any] | None = None, preempt_signals: str = preempt_relay.DEFAULT_SIGNALS,
                preempt_notice: str = "none", why: str = preempt_relay.SCRIPT_WHY,
                forked_main: Callable[[list[str]], None] | None = None) -> int:
    """Run `python argv...` (or `program argv...`) on every rank; return the exit status for the shell.

    `forked_main`: a function that does in a worker what `python -u argv...` would, given argv; the workers
    then fork from a server that imported torch once (forked.py) instead of each starting an interpreter.
    The agent passes `preempt_signals` on to the workers; when one stops it, the exit is PREEMPTED_EXIT
    once the workers have saved (their note says where: worker/preemption.py), not a traceback, else 128+N.
    """
    agent_signals = {"signals_to_handle": preempt_relay.agent_signals(preempt_signals)}
    if forked_main is not None:
        entrypoint, args = failures.Recorded(forked_main), [argv]
    else:
        entrypoint, args = program or sys.executable, argv if program else ["-u", *argv]
    with preempt_relay.noting(preempt_signals, preempt_notice) as note:
        try:
            _start(cfg, entrypoint, args, {**(overrides or {}), **agent_signals})
        except LaunchError as exc:
            return failures.report(exc.summary)
        except SignalException as exc:
            # The agent has passed the signal on to the workers and waited for them.
            return preempt_relay.report(note, exc.sigval, why)
    return 0


def run_script(cfg: LaunchConfig, script: str, script_args: list[str],
               torchrun: dict[str, Any] | None = None, preempt_signals: str = preempt_relay.DEFAULT_SIGNALS,
               preempt_notice: str = "none") -> int:
    """`torchfleet run script.py args`: the script runs as __main__ on every rank.

    `torchrun` holds the torchrun flags torchfleet passes through (-m, --no-python,
    --log-dir, --redirects, ...), by torchrun's own names.
    """
    torchrun = torchrun or {}
    if not torchrun.get("no_python") and not torchrun.get("module"):
        if not os.path.isfile(script):
            raise UsageError(f"script {script!r} does not exist; give the path to a Python file"
                             " (or -m for a module, --no-python for a program)")
        if not script.endswith(".py"):
            raise UsageError(f"script {script!r} is not a Python file (.py); run a module with -m,"
                             " a program with --no-python")
    overrides = torchrun_flags.agent_overrides(torchrun, script, script_args, one_machine=not cfg.multi_node)
    leaving: dict[str, Any] = {"preempt_signals": preempt_signals, "preempt_notice": preempt_notice}
    if torchrun.get("no_python"):
        return run_command(cfg, script_args, program=script, overrides=overrides, **leaving)
    target = ["-m", script] if torchrun.get("module") else [script]
    # Not `python -u`: the bootstrap makes the streams line-buffered instead, so each
    # rank's lines reach the shared terminal whole and at once (bootstrap.line_buffered).
    return run_command(cfg, ["-m", "torchfleet.worker.bootstrap", *target, *script_args],
                       program=sys.executable, overrides=overrides, **leaving)


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
    results = _start(cfg, failures.Recorded(fn, as_bytes=True), list(args))
    # Each result crossed as pickled bytes: torch's queue would have sent its tensors as shared memory, each
    # holding a file descriptor here for as long as the tensor lives (a test suite that kept the weights its
    # launches returned held 1,878 of them, and select() fails past 1,024).
    return [pickle.loads(results[rank]) for rank in sorted(results)]
