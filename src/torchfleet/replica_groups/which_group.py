"""Which replica group a Fleet joins, if any: per-step averaging, or diloco's and localsgd's meetings.

Fleet asks twice: before the strategy is built (`plan`: is this process in a
replica group, and does the strategy meet every few steps?) and once its
device is known (`group`: torchft's side of it, started by `attach` later).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchfleet.env.replicas import ReplicaEnv
from torchfleet.errors import UsageError
from torchfleet.replica_groups.sync_methods import SyncOptions, methods, refuse_alone
from torchfleet.strategies import registry
from torchfleet.strategies.options import ReplicaGroupOptions, StrategyOptions


@dataclass(frozen=True)
class Plan:
    env: ReplicaEnv | None  # this process's replica group, None outside one
    meeting: SyncOptions | None  # diloco, localsgd: the groups meet every few steps (else every step)
    strategy_options: StrategyOptions  # what is left for the strategy inside the group


def plan(strategy: str, fault_tolerance: str | None, options: StrategyOptions) -> Plan:
    if strategy not in methods():
        env = ReplicaEnv.for_fleet(fault_tolerance)
        if env is not None:
            refuse_shared_memory(strategy)
        return Plan(env, None, options)
    meeting = meeting_of(strategy, options)
    rest = dataclasses.replace(options, replica_groups=ReplicaGroupOptions())  # ddp's, inside each group
    if fault_tolerance == "restart":
        raise UsageError(
            f"{strategy} runs its replica groups under torchft, which is per-step fault tolerance"
            " already; leave fault_tolerance out"
        )
    env = ReplicaEnv.for_fleet("step" if ReplicaEnv.detect() is not None else None)
    if env is None:
        raise UsageError(
            f"{strategy} meets across replica groups, and this process is in none: train with"
            f" `torchfleet train --strategy {strategy} -n 2` (it makes a group per process on one"
            " machine, a group per machine with --nnodes), or launch the script with torchfleet run"
            " --fault-tolerance step --nnodes 2 or more"
        )
    refuse_alone(strategy, env.groups)
    return Plan(env, meeting, rest)


def refuse_shared_memory(strategy: str) -> None:
    """A strategy whose workers share one machine's memory (hogwild's spawn) has no replica groups to join."""
    preset = registry.find(strategy)
    if preset is not None and preset.launch == "spawn":
        raise UsageError(
            f"{strategy} shares memory inside one machine and has no gradients to average across"
            " replica groups; use ddp (or fsdp) with --fault-tolerance step"
        )


def meeting_of(method: str, options: StrategyOptions) -> SyncOptions:
    """diloco's or localsgd's meetings as `options` set them, validated (one sentence for a bad value)."""
    return SyncOptions(method, **{k: v for k, v in dataclasses.asdict(options.replica_groups).items() if v is not None})


def group(planned: Plan, dist_env, device):
    """torchft's side of the planned group (its Manager starts at `attach`), or None outside one."""
    if planned.env is None:
        return None
    if planned.meeting is not None:
        from torchfleet.replica_groups.outer_step import OuterGroup

        return OuterGroup(planned.env, dist_env, device, planned.meeting)
    from torchfleet.replica_groups.per_step import ReplicaGroup

    return ReplicaGroup(planned.env, dist_env, device)
