"""Starting processes, always through torchrun's own agent, and reading back how they ended.

`run_command` and `launch` hand torchrun's `LaunchConfig` (elastic_config.py builds it from
torchrun's knobs) to `elastic_launch`: the agent that starts, watches and restarts workers is
PyTorch's, not ours. What we add is the choice of rendezvous (loopback and a free port on one
machine; ports.py checks them first) and one readable summary when a rank fails, without any
decorator in user code.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from typing import Any, Callable

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import elastic_launch

from torchfleet import netif
from torchfleet.config import LaunchConfig
from torchfleet.env.name_lookup import absorb_failed_lookup_warning
from torchfleet.errors import UsageError
from torchfleet.launcher import failures, forked, groups, preempt_relay, preflight, torchrun_flags
from torchfleet.launcher.elastic_config import agent_config, node_in_messages, worker_env
from torchfleet.launcher.environ import exported
from torchfleet.launcher.ports import check_ports


class LaunchError(RuntimeError):
    """One or more ranks failed; the message is the failure summary."""

    def __init__(self, summary: failures.FailureSummary):
        super().__init__(summary.render())
        self.summary = summary


def exposure(cfg: LaunchConfig) -> str:
    """The sentence a multi-machine run prints: what it opens to the network."""
    # The store listens where the rendezvous says: the c10d endpoint (--rdzv-endpoint,
    # on whichever machine it names), else the master's port on node 0.
    host, port = cfg.endpoint
    hosts_store = netif.is_local(host) if cfg.elastic else cfg.node_rank == 0
    who = "this machine" if cfg.elastic else f"node {cfg.node_rank}"
    if hosts_store:
        return (
            f"torchfleet: {who} exposes the rendezvous store on every interface, port {port} (TCP, no"
            f" authentication), and Gloo/NCCL ports chosen by the OS; anyone who reaches them can join or"
            f" disturb the job: run it on a private network (docs/guides/security.md)"
        )
    return f"torchfleet: {who} joins the rendezvous at {host}:{port} (docs/guides/security.md)"


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


def _start(
    cfg: LaunchConfig, entrypoint: Callable | str, args: list, overrides: dict[str, Any] | None = None
) -> dict[int, Any]:
    # Before the first of the launcher's c10d sockets (the checks', the rendezvous', a replica group's).
    absorb_failed_lookup_warning(netif.source_address(cfg.endpoint[0] if cfg.elastic else cfg.master_addr))
    group = None
    if cfg.replica_groups:
        # One replica group per machine (groups.py): this machine's agent, the lighthouse checked or started.
        group = groups.prepare(cfg)
        print(f"torchfleet: {group.sentence}", flush=True)
        print(group.exposure, file=sys.stderr, flush=True)
        cfg = group.agent
    check_ports(cfg)
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
                print(f"torchfleet: {checked.sentence(node_in_messages(cfg))}", flush=True)
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
                local_rank=local_rank, pid=process.pid, exitcode=process.exitcode, error_file=path
            )


def run_command(
    cfg: LaunchConfig,
    argv: list[str],
    program: str | None = None,
    overrides: dict[str, Any] | None = None,
    preempt_signals: str = preempt_relay.DEFAULT_SIGNALS,
    preempt_notice: str = "none",
    why: str = preempt_relay.SCRIPT_WHY,
    forked_main: Callable[[list[str]], None] | None = None,
) -> int:
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


def run_script(
    cfg: LaunchConfig,
    script: str,
    script_args: list[str],
    torchrun: dict[str, Any] | None = None,
    preempt_signals: str = preempt_relay.DEFAULT_SIGNALS,
    preempt_notice: str = "none",
) -> int:
    """`torchfleet run script.py args`: the script runs as __main__ on every rank.

    `torchrun` holds the torchrun flags torchfleet passes through (-m, --no-python,
    --log-dir, --redirects, ...), by torchrun's own names.
    """
    torchrun = torchrun or {}
    if not torchrun.get("no_python") and not torchrun.get("module"):
        if not os.path.isfile(script):
            raise UsageError(
                f"script {script!r} does not exist; give the path to a Python file"
                " (or -m for a module, --no-python for a program)"
            )
        if not script.endswith(".py"):
            raise UsageError(
                f"script {script!r} is not a Python file (.py); run a module with -m, a program with --no-python"
            )
    overrides = torchrun_flags.agent_overrides(torchrun, script, script_args, one_machine=not cfg.multi_node)
    leaving: dict[str, Any] = {"preempt_signals": preempt_signals, "preempt_notice": preempt_notice}
    if torchrun.get("no_python"):
        return run_command(cfg, script_args, program=script, overrides=overrides, **leaving)
    target = ["-m", script] if torchrun.get("module") else [script]
    # Not `python -u`: the bootstrap makes the streams line-buffered instead, so each
    # rank's lines reach the shared terminal whole and at once (bootstrap.line_buffered).
    return run_command(
        cfg,
        ["-m", "torchfleet.worker.bootstrap", *target, *script_args],
        program=sys.executable,
        overrides=overrides,
        **leaving,
    )


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
