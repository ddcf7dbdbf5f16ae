"""DistEnv: which process this is and where the others are, detected from its launcher's variables.

One detector per launcher (torchrun, a Kubeflow PyTorchJob pod, Slurm, MPI, SageMaker), tried in
the order of ``_DETECTORS``; none recognising its variables means one process. Slurm's layout is
read in slurm_layout.py, every variable through variables.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torchfleet.env import slurm_layout, variables
from torchfleet.env.sagemaker import resource_config_path
from torchfleet.env.variables import DEFAULT_ADDR, DEFAULT_PORT, EnvError, has, integer

SAGEMAKER_PORT = 7777  # the port SageMaker's own distributed toolkits use


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str = DEFAULT_ADDR
    master_port: int = DEFAULT_PORT
    source: str = "single"  # the detector: torchrun, pytorchjob, slurm, mpi, sagemaker, single
    # How many times torchrun's agent has restarted the group (TORCHELASTIC_RESTART_COUNT):
    # above 0, a trainer resumes from its newest checkpoint on its own.
    restart_count: int = 0

    def __post_init__(self) -> None:
        # Local numbers first: a bad LOCAL_RANK is what puts a derived rank out of range.
        lws, ws = self.local_world_size, self.world_size
        checks = (
            (ws >= 1, f"WORLD_SIZE={ws} must be at least 1"),
            (0 <= self.local_rank < lws, f"LOCAL_RANK={self.local_rank} is out of range for LOCAL_WORLD_SIZE={lws}"),
            (lws <= ws, f"LOCAL_WORLD_SIZE={lws} is larger than WORLD_SIZE={ws}"),
            (0 <= self.node_rank < self.nnodes, f"NODE_RANK={self.node_rank} is out of range for NNODES={self.nnodes}"),
            (0 <= self.rank < ws, f"RANK={self.rank} is out of range for WORLD_SIZE={ws}"),
            (1 <= self.master_port <= 65535, f"MASTER_PORT={self.master_port} is not a TCP port (expected 1 to 65535)"),
            (bool(self.master_addr), "MASTER_ADDR is empty"),
        )
        for ok, problem in checks:
            if not ok:
                raise EnvError(f"{problem} (from {self.source})")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def torch_env(self) -> dict[str, str]:
        """torchrun's variables for this process, as init_process_group("env://") reads them.

        GROUP_WORLD_SIZE (torchrun sets it too) keeps nnodes exact when nodes
        run unequal numbers of processes, so detect(torch_env()) round-trips.
        """
        values = {
            "RANK": self.rank,
            "LOCAL_RANK": self.local_rank,
            "WORLD_SIZE": self.world_size,
            "LOCAL_WORLD_SIZE": self.local_world_size,
            "GROUP_RANK": self.node_rank,
            "GROUP_WORLD_SIZE": self.nnodes,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
        }
        return {name: str(value) for name, value in values.items()}

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """The first detector in ``_DETECTORS`` that recognises its variables wins."""
        environ = os.environ if environ is None else environ
        for detector in _DETECTORS:
            found = detector(environ)
            if found is not None:
                return found
        return _single(environ)


# --- detectors, tried in the order of _DETECTORS ---------------------------------


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv | None:
    # torchrun also sets TORCHELASTIC_RUN_ID, but people who drive "env://"
    # by hand set only these three, and they mean the same thing.
    if not has(environ, "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        return None
    world_size = integer(environ, "WORLD_SIZE")
    local_world_size = integer(environ, "LOCAL_WORLD_SIZE", default=world_size)
    nnodes_guess = max(1, world_size // local_world_size) if local_world_size > 0 else 1
    return DistEnv(
        rank=integer(environ, "RANK"),
        local_rank=integer(environ, "LOCAL_RANK"),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=integer(environ, "GROUP_RANK", default=0),
        nnodes=integer(environ, "GROUP_WORLD_SIZE", default=nnodes_guess),
        master_addr=environ.get("MASTER_ADDR", DEFAULT_ADDR),
        master_port=variables.master_port(environ),
        restart_count=integer(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
        source="torchrun",
    )


def _from_pytorchjob(environ: Mapping[str, str]) -> DistEnv | None:
    # A Kubeflow PyTorchJob pod started without torchrun: the training
    # operator sets RANK to the pod's index and WORLD_SIZE to pods x
    # nprocPerNode, plus PET_NNODES / PET_NODE_RANK / PET_NPROC_PER_NODE for
    # torchrun, but no LOCAL_RANK (training-operator, controller.v1/pytorch/envvar.go).
    # Older operators set only RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT:
    # one process per pod, as in the env:// recipe.
    if not has(environ, "RANK", "WORLD_SIZE") or "LOCAL_RANK" in environ:
        return None
    world_size = integer(environ, "WORLD_SIZE")
    nnodes = integer(environ, "PET_NNODES", default=world_size)
    raw_nproc = environ.get("PET_NPROC_PER_NODE", "1")
    if raw_nproc.isdigit() and int(raw_nproc) > 1:
        raise EnvError(
            f"PET_NPROC_PER_NODE={raw_nproc} asks for {raw_nproc} processes in this "
            f"pod but it was started as one; start the script with torchrun "
            f"(the manifest `torchfleet k8s` writes does)"
        )
    rank = integer(environ, "RANK")
    return DistEnv(
        rank=rank,
        local_rank=0,
        world_size=world_size,
        local_world_size=1,
        node_rank=integer(environ, "PET_NODE_RANK", default=rank),
        nnodes=nnodes,
        master_addr=environ.get("MASTER_ADDR", DEFAULT_ADDR),
        master_port=variables.master_port(environ),
        source="pytorchjob",
    )


def _from_slurm(environ: Mapping[str, str]) -> DistEnv | None:
    # srun sets SLURM_PROCID and SLURM_NTASKS for every task. Inside a step the
    # SLURM_STEP_* values describe that step, which may use part of the job.
    if not has(environ, "SLURM_PROCID", "SLURM_NTASKS"):
        return None
    world_size = integer(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nnodes = integer(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
    node_rank = integer(environ, "SLURM_NODEID", default=0)
    return DistEnv(
        rank=integer(environ, "SLURM_PROCID"),
        local_rank=integer(environ, "SLURM_LOCALID", default=0),
        world_size=world_size,
        local_world_size=slurm_layout.tasks_on_node(environ, node_rank, world_size, nnodes),
        node_rank=node_rank,
        nnodes=nnodes,
        master_addr=slurm_layout.master_addr(environ, nnodes),
        master_port=slurm_layout.master_port(environ),
        source="slurm",
    )


def _from_openmpi(environ: Mapping[str, str]) -> DistEnv | None:
    if not has(environ, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        return None
    # OMPI_COMM_WORLD_NODE_RANK is not this node's index: it is this process's
    # rank among all processes on the node, across jobs. Never use it as node_rank.
    return _mpi_env(
        environ,
        integer(environ, "OMPI_COMM_WORLD_RANK"),
        integer(environ, "OMPI_COMM_WORLD_SIZE"),
        integer(environ, "OMPI_COMM_WORLD_LOCAL_RANK"),
        integer(environ, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        pass_it="mpirun -x MASTER_ADDR=...",
    )


def _from_mpich(environ: Mapping[str, str]) -> DistEnv | None:
    # MPICH's and Intel MPI's Hydra launcher set PMI_RANK and PMI_SIZE, and
    # usually MPI_LOCALRANKID / MPI_LOCALNRANKS.
    if not has(environ, "PMI_RANK", "PMI_SIZE"):
        return None
    rank = integer(environ, "PMI_RANK")
    world_size = integer(environ, "PMI_SIZE")
    if "MPI_LOCALNRANKS" in environ:
        local_rank = integer(environ, "MPI_LOCALRANKID")
        local_world_size = integer(environ, "MPI_LOCALNRANKS")
    else:
        # Without the local variables the layout is unknowable; assume every
        # rank is on this one node (the common `mpiexec -n N` on a workstation).
        local_rank, local_world_size = rank, world_size
    return _mpi_env(environ, rank, world_size, local_rank, local_world_size, pass_it="mpiexec -genv MASTER_ADDR ...")


def _mpi_env(
    environ: Mapping[str, str], rank: int, world_size: int, local_rank: int, local_world_size: int, pass_it: str
) -> DistEnv:
    if local_world_size < 1:
        raise EnvError(f"LOCAL_WORLD_SIZE={local_world_size} must be at least 1 (from mpi)")
    # mpirun's default mapping fills each node's slots in turn, so with the
    # same number of ranks per node, node k holds ranks [k*L, (k+1)*L).
    nnodes = -(-world_size // local_world_size)
    if "MASTER_ADDR" in environ:
        master_addr = environ["MASTER_ADDR"]
    elif local_world_size == world_size:
        master_addr = DEFAULT_ADDR
    else:
        raise EnvError(
            f"MASTER_ADDR is not set and the {world_size} MPI ranks span {nnodes} "
            f"nodes; set MASTER_ADDR to the first host and pass it with `{pass_it}`"
        )
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size,
        nnodes=nnodes,
        master_addr=master_addr,
        master_port=variables.master_port(environ),
        source="mpi",
    )


def _from_sagemaker(environ: Mapping[str, str]) -> DistEnv | None:
    if has(environ, "SM_HOSTS", "SM_CURRENT_HOST"):
        hosts = _sagemaker_hosts(environ["SM_HOSTS"])
        current = environ["SM_CURRENT_HOST"]
    else:
        found = _sagemaker_resource_config(environ)
        if found is None:
            return None
        hosts, current = found
    if current not in hosts:
        raise EnvError(f"SM_CURRENT_HOST={current!r} is not one of SM_HOSTS={hosts}")
    # The training toolkit already sorts SM_HOSTS, and every host sees the same list.
    node_rank = hosts.index(current)
    gpus = integer(environ, "SM_NUM_GPUS", default=0)
    local_world_size = gpus if gpus > 0 else 1  # one process per GPU, one on CPU instances
    local_rank = integer(environ, "LOCAL_RANK", default=0)
    return DistEnv(
        rank=node_rank * local_world_size + local_rank,
        local_rank=local_rank,
        world_size=len(hosts) * local_world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        nnodes=len(hosts),
        master_addr=hosts[0],
        master_port=variables.master_port(environ, default=SAGEMAKER_PORT),
        source="sagemaker",
    )


def _sagemaker_resource_config(environ: Mapping[str, str]) -> tuple[list[str], str] | None:
    """(hosts, current host) from the job's resourceconfig.json, for an entry point that
    runs without the training toolkit's SM_* variables (a bring-your-own container)."""
    path = resource_config_path(environ)
    try:
        config = json.loads(path.read_text())
        hosts, current = config["hosts"], config["current_host"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        raise EnvError(
            f'{path} is not a SageMaker resource config (expected JSON with "hosts" and "current_host")'
        ) from None
    return _sagemaker_hosts(json.dumps(hosts)), str(current)


def _sagemaker_hosts(raw: str) -> list[str]:
    try:
        hosts = json.loads(raw)
    except ValueError:
        hosts = None
    if not (isinstance(hosts, list) and hosts and all(isinstance(h, str) for h in hosts)):
        raise EnvError(f'SM_HOSTS={raw!r} is not a JSON list of host names (expected e.g. \'["algo-1", "algo-2"]\')')
    return hosts


def _single(environ: Mapping[str, str]) -> DistEnv:
    return DistEnv(master_port=variables.master_port(environ))


_Detector = Callable[[Mapping[str, str]], DistEnv | None]
# The precedence, in one place. torchrun comes first because it also runs
# inside srun steps and mpirun jobs, and then its variables describe the worker.
_DETECTORS: tuple[_Detector, ...] = (
    _from_torchrun,
    _from_pytorchjob,
    _from_slurm,
    _from_openmpi,
    _from_mpich,
    _from_sagemaker,
)

detect = DistEnv.detect
