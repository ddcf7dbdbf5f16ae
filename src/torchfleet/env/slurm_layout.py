"""Where a Slurm task's peers are, from srun's variables: tasks on its node, the master's address and port.

Slurm's notations themselves are parsed in slurm.py; here a malformed one is an EnvError naming
the variable. The Slurm detector (dist_env.py) builds its DistEnv from these.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchfleet.env import slurm as slurm_notation
from torchfleet.env import variables
from torchfleet.env.variables import DEFAULT_ADDR, EnvError, first, integer


def tasks_on_node(environ: Mapping[str, str], node_rank: int, world_size: int, nnodes: int) -> int:
    if "SLURM_NTASKS_PER_NODE" in environ:
        return integer(environ, "SLURM_NTASKS_PER_NODE")
    found = first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if found is None:
        return max(1, world_size // max(1, nnodes))
    name, value = found
    counts = _expand_tasks_per_node(name, value)
    if not 0 <= node_rank < len(counts):
        raise EnvError(f"{name}={value!r} lists {len(counts)} nodes, so it has no entry for SLURM_NODEID={node_rank}")
    return counts[node_rank]


def _expand_tasks_per_node(name: str, value: str) -> list[int]:
    """Slurm's compressed counts, one per node: "2(x3),1" -> [2, 2, 2, 1]."""
    try:
        return slurm_notation.task_counts(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not a Slurm task count list (expected e.g. '2(x3),1')") from None


def master_addr(environ: Mapping[str, str], nnodes: int) -> str:
    if "MASTER_ADDR" in environ:
        return environ["MASTER_ADDR"]
    if nnodes == 1:
        # Every task is on this node: loopback always works, while the node's
        # Slurm name may not resolve, or resolve to an address nobody listens on.
        return DEFAULT_ADDR
    found = first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if found is not None:
        return expand_hostlist(found[1], name=found[0])[0]
    raise EnvError(
        f"neither MASTER_ADDR nor SLURM_JOB_NODELIST is set and the step spans "
        f"{nnodes} nodes; export MASTER_ADDR=<first host> before srun"
    )


def master_port(environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" in environ or "SLURM_JOB_ID" not in environ:
        return variables.master_port(environ)
    # Every task of a job sees the same SLURM_JOB_ID, so all agree on the port
    # without talking; consecutive jobs sharing a node get different ports
    # (they collide only when their ids differ by a multiple of 10000); and
    # 15000-24999 lies below Linux's ephemeral range (32768-60999), so the
    # kernel will not have handed it to some outgoing connection.
    return 15000 + integer(environ, "SLURM_JOB_ID") % 10000


def expand_hostlist(hostlist: str, name: str = "hostlist") -> list[str]:
    """Expand Slurm's compressed hostlist, as ``scontrol show hostnames`` does.

    "node[01-03,07]" -> node01 node02 node03 node07; "a[1-2],b3" -> a1 a2 b3;
    "gpu-[001-002]-ib" -> gpu-001-ib gpu-002-ib. Zero padding is kept, and
    several bracket groups in one name multiply out. ``name`` labels the
    value in the error a malformed hostlist raises.
    """
    try:
        return slurm_notation.hosts(hostlist)
    except ValueError as err:
        raise EnvError(f"{name}={hostlist!r} is not a Slurm hostlist: {err} (expected e.g. 'node[01-04,07]')") from None
