"""What a strategy's name and options come to in this process, settled once, before anything starts.

Whatever process reads the user's words settles them, once: `torchfleet train`'s launcher for the
workers it starts (`settle_for_launch`, carried to them with the job), or `Fleet(...)` in a script
started by `torchfleet run`, torchrun, Slurm or mpirun. Everything a name decides is decided here:
the preset's defaults under the caller's options, the replica group and its meetings, whether this
process joins a process group, the degrees on this job and the class that runs them. A
combination that cannot run is refused here, in one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from torchfleet.env import DistEnv
from torchfleet.errors import UsageError
from torchfleet.replica_groups import which_group
from torchfleet.strategies import Runtime, Strategy, class_for, dims_of, get_strategy, registry
from torchfleet.strategies.dims import ParallelDims
from torchfleet.strategies.distributed import MeshStrategy
from torchfleet.strategies.options import StrategyOptions


@dataclass
class StrategySpec:
    name: str  # as asked for
    preset: registry.Preset
    cls: type[Strategy]  # the class that runs it in this process
    dims: ParallelDims | None  # its degrees on this job; None for one process
    options: StrategyOptions  # the preset's defaults under the caller's, in their groups
    joined: which_group.Plan  # its replica group and their meetings, or none
    grouped: bool  # this process joins a process group (several processes, or a launcher's group of one)
    notes: list[str] = field(default_factory=list)

    def build(self, runtime: Runtime) -> Strategy:
        if self.dims is None:  # a one-process class: a degree given to it is refused in its own words
            return self.cls(runtime, self.options)
        mesh = cast(type[MeshStrategy], self.cls)  # degrees: the mesh's class
        return mesh(runtime, self.options, self.dims)


def settle(name: str, given: dict, env: DistEnv, fault_tolerance: str | None) -> StrategySpec:
    cls = get_strategy(name)  # an unknown name is one sentence naming those there are
    preset = registry.presets()[name]
    joined = which_group.plan(name, fault_tolerance, StrategyOptions.of(registry.options_for(name, given)))
    meeting, options = joined.meeting, joined.strategy_options
    if meeting is not None and env.world_size == 1:  # a group of one process: nothing to share in it
        cls = get_strategy(registry.REFERENCE)
    alone = env.source == "torchrun" and env.world_size == 1 and preset.group_of_one
    grouped = env.is_distributed or alone
    notes = []
    if cls.distributed and not grouped:
        notes.append(f"{name} with one process has nothing to share; running it as {registry.REFERENCE}")
        cls, options = get_strategy(registry.REFERENCE), StrategyOptions()
    if env.is_distributed and preset.launch == "spawn":
        raise UsageError(
            f"{name} starts its own workers on one machine; run it with"
            f" `torchfleet train --strategy {name} -n N`, not under torchrun, Slurm or mpirun"
        )
    if env.is_distributed and not cls.distributed:
        raise UsageError(
            f"strategy {name!r} runs in one process but {env.world_size} were started;"
            " use -n 1, or a multi-process strategy such as ddp"
        )
    dims = None
    if cls.distributed:  # (still distributed: several processes, or a group of one)
        dims = dims_of(name, env.world_size, env.nnodes, options)  # options: the preset's defaults are in them
        assert dims is not None  # a distributed strategy always has degrees
        if not alone:
            cls = class_for(dims)  # the degrees pick the class: ddp with --pp 2 runs as ddp+pipeline
    return StrategySpec(name, preset, cls, dims, options, joined, grouped, notes)


def settle_for_launch(name: str, given: dict, nproc: int, nodes: range) -> dict[int, StrategySpec]:
    """The spec of each world size a launch of `nproc` processes on each of `nodes` machines can come to
    (one, unless --nnodes is a range), settled in the launcher for the workers it starts: as torchrun's
    agent starts them, each finds its rank in torchrun's variables, and nothing else to decide.

    The whole job's size is refused here if it cannot run. A smaller one an elastic job may shrink to
    and cannot run at is left out: its workers refuse it themselves, should the job come to it."""
    specs = {}
    for machines in reversed(nodes):
        env = DistEnv(world_size=nproc * machines, local_world_size=nproc, nnodes=machines, source="torchrun")
        try:
            specs[env.world_size] = settle(name, given, env, None)
        except UsageError:
            if machines == nodes[-1]:
                raise
    return specs
