"""`torchfleet train` from parsed flags to a finished job: where it runs, on how many processes.

The command line only parses and builds the configs; the decisions are here.
Inside a job that already has its processes (torchrun, Slurm, mpirun, a
SageMaker training job) it trains in this process. Otherwise it plans the
processes, settles the strategy for them, checks what can be checked before
any of them starts (output paths, the degrees' arithmetic, the batch split),
and starts them through torchrun's agent, each given the config and the
settled spec to train with (not the command line to parse again); hogwild
alone spawns its workers itself, since they must share this process's memory.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import sys

from torchfleet.config import LaunchConfig
from torchfleet.data import check_global_batch
from torchfleet.env import DistEnv
from torchfleet.errors import UsageError
from torchfleet.launcher import failures, forked, preempt_relay
from torchfleet.launcher.agent import LaunchError, run_command
from torchfleet.launcher.failures import PREEMPTED_EXIT
from torchfleet.replica_groups import torchft_setup, which_group
from torchfleet.replica_groups.on_one_machine import run_groups_here
from torchfleet.replica_groups.sync_methods import refuse_alone
from torchfleet.strategies import get_strategy, registry, resolve_dims
from torchfleet.strategies.batchnorm import check_sync_batchnorm
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategy_spec import StrategySpec, settle_for_launch
from torchfleet.train.config import TrainConfig, check_dashboard
from torchfleet.train.loop import train
from torchfleet.train.processes import plan_processes
from torchfleet.worker import preemption


def run(cfg: TrainConfig, launch: LaunchConfig, nproc: int | None, argv: list[str]) -> int:
    """Train `cfg`; `nproc` is -n as given (None: choose), `argv` the command's own arguments."""
    cfg.check_outputs()
    env = DistEnv.detect()
    if env.is_distributed or env.source != "single":
        return _train_here(cfg, env)  # started by torchrun, Slurm...: its rank 0 binds --dashboard's port (or refuses)
    if cfg.dashboard is not None:  # the command that starts the workers, once, before any starts
        from torchfleet.view.server import check_serves_here

        check_serves_here(launch.node_rank)
        check_dashboard(cfg.dashboard)
    # Many machines make a multi-process job even with one process each: auto means its choice for several.
    many = launch.multi_node
    strategy, nproc, why = plan_processes(
        registry.AUTO_SEVERAL if many and cfg.strategy == "auto" else cfg.strategy, nproc
    )
    if many and not get_strategy(strategy).distributed:
        raise UsageError(
            f"strategy {strategy!r} runs in one process, not one per machine of"
            f" --nnodes {launch.nnodes}; use a multi-process strategy such as ddp"
        )
    launch = dataclasses.replace(launch, nproc_per_node=nproc)
    if why:
        print(f"torchfleet: {why}", flush=True)
    starts = registry.presets()[strategy].launch  # agent, one process, spawn (hogwild), replica groups
    if starts == "replica groups":
        # ddp inside each replica group, the groups meeting every few steps under torchft: a group per
        # machine, or on one machine a group per process. Bad options are refused before any starts.
        which_group.meeting_of(strategy, StrategyOptions.of(registry.options_for(strategy, cfg.strategy_options)))
        reason = torchft_setup.unavailable()
        if reason:
            raise UsageError(f"{strategy} runs on torchft, which cannot run here: {reason}")
        refuse_alone(strategy, launch.max_nodes if launch.multi_node else nproc)
        if not launch.multi_node:
            return run_groups_here(launch, argv, strategy)
        launch = dataclasses.replace(launch, fault_tolerance="step")
    if launch.replica_groups:
        which_group.refuse_shared_memory(strategy)
    if starts == "spawn":
        return _train_spawned(cfg, launch, strategy)
    if not launch.multi_process and not launch.replica_groups:  # a replica group always runs under the agent
        train(cfg, strategy)  # settled there: this process read the words and trains in itself
        return 0
    # Before any process starts: the degrees multiply out, and the batch splits among
    # the processes that read data. Replica groups are alike: each machine's processes
    # make one group, and every group reads its share of each global batch; each of
    # their workers settles the strategy itself, in the group it finds itself in.
    world, copies = (launch.nproc_per_node, launch.max_nodes) if launch.replica_groups else (launch.world_size, 1)
    nodes = range(launch.min_nodes, launch.max_nodes + 1)
    specs = {} if launch.replica_groups else settle_for_launch(strategy, cfg.strategy_options, nproc, nodes)
    dims = specs[world].dims if specs else resolve_dims(strategy, world, options=cfg.strategy_options)
    check_global_batch(cfg.batch_size, copies * (dims.dp if dims is not None else world))
    options = (
        specs[world].options if specs else StrategyOptions.of(registry.options_for(strategy, cfg.strategy_options))
    )
    if options.replication.sync_batchnorm and dims is not None:  # refused for pipelines before they start
        check_sync_batchnorm(dims.pp, sync_batchnorm=True)  # (a single-process strategy refuses it itself)
    return _run_workers(cfg, launch, Carried(dataclasses.replace(cfg, strategy=strategy), specs))


@dataclasses.dataclass(frozen=True)
class Carried:
    """What each worker trains: the config as parsed here, and the spec settled here for each world
    size the job can have (none for replica groups: each worker settles it in the group it is in)."""

    cfg: TrainConfig  # its strategy "auto" resolved
    specs: dict[int, StrategySpec]


def _run_workers(cfg: TrainConfig, launch: LaunchConfig, carried: Carried) -> int:
    """Start the workers through torchrun's agent; a preemption signal to this process ends in
    PREEMPTED_EXIT once the workers have saved (launcher/preempt_relay.py), not in a traceback."""
    return run_command(
        launch,
        [],  # worker_main is given the job itself: no command line to run
        preempt_signals=cfg.preempt_signals,
        preempt_notice=cfg.preempt_notice,
        why=preempt_relay.TRAIN_WHY,
        forked_main=functools.update_wrapper(functools.partial(worker_main, carried), worker_main),
    )


def worker_main(carried: Carried, _argv: list[str]) -> None:
    """A worker of the agent, forked from the launcher's server (launcher/forked.py) without importing torch
    again: it trains what the launcher carried to it, neither parsing a command line nor settling the strategy."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):  # as -u: each rank's lines go out at once
            stream.reconfigure(line_buffering=True, write_through=True)
    carried.cfg.check_outputs()
    env = DistEnv.detect()
    code = _train_here(carried.cfg, env, carried.specs.get(env.world_size) or carried.cfg.strategy)
    if code != 0:
        raise SystemExit(code)
    # A worker function returns on success: torch's agent waits for its (None) result.


def _train_here(cfg: TrainConfig, env: DistEnv, strategy: StrategySpec | str | None = None) -> int:
    """One of many processes already (the agent's, torchrun's, Slurm's, mpirun's, SageMaker's): train in this
    one, with the spec the launcher settled, or else settling the strategy here (this process read the words)."""
    if strategy is None:
        strategy = cfg.strategy if cfg.strategy != "auto" else registry.auto(env.world_size)
    code = 0
    try:
        failures.call_recorded(train, cfg, strategy)
    except preemption.Preempted:  # saved and told to leave; under torchrun's agent call_recorded has exited
        code = PREEMPTED_EXIT
    if forked.in_worker:
        return code  # a forked worker leaves by os._exit itself, once the agent has its result (forked.py)
    if env.is_distributed or env.source == "torchrun":  # torchrun's one process may hold a group of one
        # Work done, results written, process group closed. Gloo's threads can
        # still abort in C++ destructors during interpreter teardown ("terminate
        # called without an active exception", now and then, not every run), which
        # would turn a finished job into a failure: leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _train_spawned(cfg: TrainConfig, launch: LaunchConfig, strategy: str) -> int:
    # Hogwild's workers must share this process's memory, so this process
    # spawns them (torchfleet.hogwild) instead of torchrun's agent.
    if launch.multi_node:
        raise UsageError(
            f"{strategy} shares memory on one machine; --nnodes {launch.nnodes} is not"
            " possible with it, use ddp across machines"
        )
    try:
        train(cfg, strategy, nproc=launch.nproc_per_node)  # settled there, carried to the workers
    except LaunchError as exc:
        return failures.report(exc.summary)
    return 0
