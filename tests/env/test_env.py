"""DistEnv.detect() against the variables each launcher really sets."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchfleet.env import DistEnv, EnvError, detect, dist_env, expand_hostlist

# A worker of `torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d ...`
# on the second node, as torch.distributed.elastic's agent exports it.
TORCHRUN = {
    "RANK": "6",
    "LOCAL_RANK": "2",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "6",
    "ROLE_WORLD_SIZE": "8",
    "ROLE_NAME": "default",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job42",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "False",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "OMP_NUM_THREADS": "1",
}

# Task 3 of `sbatch --nodes 2 --ntasks-per-node 2` + `srun python train.py`, on node08.
SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "SLURM_NODELIST": "node[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOBID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_GTIDS": "2,3",
    "SLURMD_NODENAME": "node08",
    "SLURM_CPUS_ON_NODE": "32",
}

# Rank 1 of `mpirun -np 4 -H a:2,b:2 ...` (OpenMPI): on the first node.
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_UNIVERSE_SIZE": "4",
    "OMPI_MCA_orte_ess_num_procs": "4",
}

# Rank 2 of `mpiexec -n 4 -ppn 2 -hosts a,b ...` (MPICH / Intel MPI Hydra).
MPICH = {
    "PMI_RANK": "2",
    "PMI_SIZE": "4",
    "PMI_FD": "6",
    "MPI_LOCALRANKID": "0",
    "MPI_LOCALNRANKS": "2",
    "MASTER_ADDR": "a",
}

# The second host of a 2-host ml.p3.8xlarge training job (4 GPUs), local process 3.
SAGEMAKER = {
    "SM_HOSTS": '["algo-1","algo-2"]',
    "SM_CURRENT_HOST": "algo-2",
    "SM_NUM_GPUS": "4",
    "SM_NUM_CPUS": "32",
    "SM_NETWORK_INTERFACE_NAME": "eth0",
    "LOCAL_RANK": "3",
}


# The Worker pod of index 0 in a PyTorchJob with Master + 2 Workers, nprocPerNode "1",
# as training-operator (controller.v1/pytorch/envvar.go, master.go) sets them.
PYTORCHJOB = {
    "PYTHONUNBUFFERED": "1",
    "MASTER_PORT": "23456",
    "MASTER_ADDR": "train-master-0",
    "WORLD_SIZE": "3",
    "RANK": "1",
    "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "1",
    "PET_NNODES": "3",
}


def test_pytorchjob_pod_without_torchrun() -> None:
    assert DistEnv.detect(PYTORCHJOB) == DistEnv(
        rank=1,
        local_rank=0,
        world_size=3,
        local_world_size=1,
        node_rank=1,
        nnodes=3,
        master_addr="train-master-0",
        master_port=23456,
        source="pytorchjob",
    )
    # An older operator: RANK, WORLD_SIZE and the master only.
    old = {"MASTER_PORT": "23456", "MASTER_ADDR": "m-0", "WORLD_SIZE": "2", "RANK": "0"}
    assert DistEnv.detect(old) == DistEnv(
        rank=0, world_size=2, node_rank=0, nnodes=2, master_addr="m-0", master_port=23456, source="pytorchjob"
    )


def test_pytorchjob_pod_with_several_processes_needs_torchrun() -> None:
    environ = {**PYTORCHJOB, "PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "12"}
    with pytest.raises(EnvError, match="PET_NPROC_PER_NODE=4 asks for 4 processes in this pod"):
        DistEnv.detect(environ)
    # torchrun in the pod (what `torchfleet k8s` writes) sets LOCAL_RANK for each worker.
    worker = {
        **environ,
        "RANK": "5",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
    }
    found = DistEnv.detect(worker)
    assert (found.source, found.rank, found.node_rank, found.world_size) == ("torchrun", 5, 1, 12)


def test_torchrun_worker() -> None:
    assert DistEnv.detect(TORCHRUN) == DistEnv(
        rank=6,
        local_rank=2,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        nnodes=2,
        master_addr="10.0.0.1",
        master_port=29400,
        source="torchrun",
    )


def test_torchrun_without_group_world_size_divides() -> None:
    environ = {k: v for k, v in TORCHRUN.items() if k != "GROUP_WORLD_SIZE"}
    assert DistEnv.detect(environ).nnodes == 2


def test_plain_env_init_sets_only_three_variables() -> None:
    assert DistEnv.detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == DistEnv(
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        nnodes=1,
        master_addr="127.0.0.1",
        master_port=29500,
        source="torchrun",
    )


def test_srun_task() -> None:
    assert DistEnv.detect(SLURM) == DistEnv(
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        nnodes=2,
        master_addr="node07",
        master_port=15000 + 123456 % 10000,
        source="slurm",
    )
    assert DistEnv.detect(SLURM).master_port == 18456


def test_slurm_step_uses_part_of_the_job() -> None:
    # A 4-node, 8-task job whose `srun -N 2 -n 3` step runs on node[03-04].
    environ = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_NODELIST": "node[01-04]",
        "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "node[03-04]",
        "SLURM_STEP_TASKS_PER_NODE": "2,1",
        "SLURM_JOB_ID": "7",
    }
    assert DistEnv.detect(environ) == DistEnv(
        rank=2,
        local_rank=0,
        world_size=3,
        local_world_size=1,
        node_rank=1,
        nnodes=2,
        master_addr="node03",
        master_port=15007,
        source="slurm",
    )


def test_slurm_one_node_uses_loopback() -> None:
    # `sbatch --nodes 1 --ntasks-per-node 2`: the node's Slurm name need not resolve.
    environ = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "cn-unresolvable",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "42",
    }
    assert DistEnv.detect(environ) == DistEnv(
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        nnodes=1,
        master_addr="127.0.0.1",
        master_port=15042,
        source="slurm",
    )
    assert DistEnv.detect({**environ, "MASTER_ADDR": "10.2.2.2"}).master_addr == "10.2.2.2"


def test_slurm_uneven_tasks_per_node() -> None:
    environ = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "3",
        "SLURM_NNODES": "4",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
        "SLURM_NODELIST": "gpu-[001-004]-ib",
    }
    found = DistEnv.detect(environ)
    assert (found.local_world_size, found.nnodes, found.master_addr) == (1, 4, "gpu-001-ib")
    assert found.master_port == 29500  # no SLURM_JOB_ID


def test_slurm_ntasks_per_node_and_master_overrides() -> None:
    environ = {
        **SLURM,
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "garbage(",
        "SLURM_STEP_TASKS_PER_NODE": "garbage(",
        "MASTER_ADDR": "10.1.1.1",
        "MASTER_PORT": "29999",
    }
    found = DistEnv.detect(environ)
    assert (found.local_world_size, found.master_addr, found.master_port) == (2, "10.1.1.1", 29999)


def test_slurm_without_tasks_per_node_divides() -> None:
    environ = {k: v for k, v in SLURM.items() if "TASKS_PER_NODE" not in k}
    assert DistEnv.detect(environ).local_world_size == 2


def test_openmpi_across_nodes_with_master_addr() -> None:
    # OMPI_COMM_WORLD_NODE_RANK=1 here, yet this rank is on the first node.
    assert DistEnv.detect({**OPENMPI, "MASTER_ADDR": "a"}) == DistEnv(
        rank=1,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=0,
        nnodes=2,
        master_addr="a",
        master_port=29500,
        source="mpi",
    )
    last = {
        **OPENMPI,
        "MASTER_ADDR": "a",
        "MASTER_PORT": "23456",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    }
    found = DistEnv.detect(last)
    assert (found.rank, found.node_rank, found.master_port) == (3, 1, 23456)


def test_openmpi_across_nodes_without_master_addr() -> None:
    with pytest.raises(EnvError) as error:
        DistEnv.detect(OPENMPI)
    message = str(error.value)
    assert "the 4 MPI ranks span 2 nodes" in message
    assert "set MASTER_ADDR to the first host" in message
    assert "`mpirun -x MASTER_ADDR=...`" in message


def test_openmpi_one_node_needs_no_master_addr() -> None:
    environ = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert DistEnv.detect(environ) == DistEnv(
        rank=1, local_rank=1, world_size=4, local_world_size=4, node_rank=0, nnodes=1, source="mpi"
    )


def test_openmpi_odd_rank_count_rounds_nodes_up() -> None:
    environ = {**OPENMPI, "OMPI_COMM_WORLD_SIZE": "5", "MASTER_ADDR": "a"}
    assert DistEnv.detect(environ).nnodes == 3


def test_mpich_hydra() -> None:
    assert DistEnv.detect(MPICH) == DistEnv(
        rank=2,
        local_rank=0,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        nnodes=2,
        master_addr="a",
        master_port=29500,
        source="mpi",
    )
    without_addr = {k: v for k, v in MPICH.items() if k != "MASTER_ADDR"}
    with pytest.raises(EnvError, match="mpiexec -genv MASTER_ADDR"):
        DistEnv.detect(without_addr)


def test_mpich_without_local_variables_assumes_one_node() -> None:
    assert DistEnv.detect({"PMI_RANK": "2", "PMI_SIZE": "4"}) == DistEnv(
        rank=2,
        local_rank=2,
        world_size=4,
        local_world_size=4,
        node_rank=0,
        nnodes=1,
        master_addr="127.0.0.1",
        source="mpi",
    )


def test_sagemaker_gpu_host() -> None:
    assert DistEnv.detect(SAGEMAKER) == DistEnv(
        rank=7,
        local_rank=3,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        nnodes=2,
        master_addr="algo-1",
        master_port=7777,
        source="sagemaker",
    )
    assert DistEnv.detect({**SAGEMAKER, "MASTER_PORT": "8888"}).master_port == 8888


def test_sagemaker_cpu_instance() -> None:
    environ = {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "0"}
    assert DistEnv.detect(environ) == DistEnv(
        rank=1,
        local_rank=0,
        world_size=2,
        local_world_size=1,
        node_rank=1,
        nnodes=2,
        master_addr="algo-1",
        master_port=7777,
        source="sagemaker",
    )


def test_sagemaker_resource_config_without_toolkit_variables(tmp_path) -> None:
    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(
        json.dumps(
            {
                "current_host": "algo-2",
                "current_instance_type": "ml.c5.xlarge",
                "hosts": ["algo-1", "algo-2", "algo-3"],
                "network_interface_name": "eth0",
            }
        )
    )
    found = DistEnv.detect({"TORCHFLEET_SAGEMAKER_ROOT": str(tmp_path)})
    assert found == DistEnv(
        rank=1, world_size=3, node_rank=1, nnodes=3, master_addr="algo-1", master_port=7777, source="sagemaker"
    )
    (config / "resourceconfig.json").write_text("{}")
    with pytest.raises(EnvError, match="is not a SageMaker resource config"):
        DistEnv.detect({"SM_INPUT_CONFIG_DIR": str(config)})
    assert DistEnv.detect({"TORCHFLEET_SAGEMAKER_ROOT": str(tmp_path / "none")}).source == "single"


def test_single_process() -> None:
    assert DistEnv.detect({}) == DistEnv()
    assert DistEnv.detect({"PATH": "/usr/bin", "MASTER_ADDR": "x"}) == DistEnv()
    assert DistEnv.detect({"MASTER_PORT": "12345"}) == DistEnv(master_port=12345)
    single = DistEnv.detect({})
    assert (single.source, single.is_main, single.is_distributed) == ("single", True, False)


def test_precedence() -> None:
    assert [f.__name__ for f in dist_env._DETECTORS] == [
        "_from_torchrun",
        "_from_pytorchjob",
        "_from_slurm",
        "_from_openmpi",
        "_from_mpich",
        "_from_sagemaker",
    ]
    # torchrun inside an srun step: its variables describe the worker.
    assert DistEnv.detect({**SLURM, **TORCHRUN}).source == "torchrun"
    assert DistEnv.detect({**OPENMPI, **SLURM}).source == "slurm"
    assert DistEnv.detect({**MPICH, **SLURM}).source == "slurm"
    # OpenMPI may also export PMI_* through PMIx; its own variables win.
    assert DistEnv.detect({**MPICH, **OPENMPI}).rank == 1
    assert DistEnv.detect({**SAGEMAKER, **MPICH}).source == "mpi"
    # LOCAL_RANK alone (SageMaker's) is not torchrun.
    assert DistEnv.detect(SAGEMAKER).source == "sagemaker"


def test_detect_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    prefixes = ("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "SM_", "TORCHELASTIC_", "GROUP_")
    names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    for name in list(os.environ):
        if name.startswith(prefixes) or name in names:
            monkeypatch.delenv(name)
    assert detect() == DistEnv()
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert detect() == DistEnv.detect() == DistEnv.detect(TORCHRUN)


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("gpu-[001-002]-ib", ["gpu-001-ib", "gpu-002-ib"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("a,b.cluster", ["a", "b.cluster"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x[1,3],y[05-06],z", ["x1", "x3", "y05", "y06", "z"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist", ["", "node[01-", "node]1", "a,,b", "a,", "n[3-1]", "n[a-b]", "n[[1]]", "n[]", "n[1-]"]
)
def test_expand_hostlist_rejects(hostlist: str) -> None:
    with pytest.raises(EnvError) as error:
        expand_hostlist(hostlist)
    assert f"hostlist={hostlist!r} is not a Slurm hostlist" in str(error.value)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({**TORCHRUN, "RANK": "abc"}, "RANK='abc' is not an integer"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
        ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
        ({**SLURM, "SLURM_STEP_NODELIST": "node[07-"}, "SLURM_STEP_NODELIST='node[07-' is not a Slurm hostlist"),
        (
            {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x"},
            "SLURM_STEP_TASKS_PER_NODE='2(x' is not a Slurm task count list",
        ),
        (
            {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2"},
            "SLURM_STEP_TASKS_PER_NODE='2' lists 1 nodes, so it has no entry for SLURM_NODEID=1",
        ),
        ({**SLURM, "SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a' is not an integer"),
        (
            {k: v for k, v in SLURM.items() if "NODELIST" not in k},
            "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set and the step spans 2 nodes",
        ),
        ({**OPENMPI, "OMPI_COMM_WORLD_SIZE": "four"}, "OMPI_COMM_WORLD_SIZE='four' is not"),
        (
            {k: v for k, v in OPENMPI.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"},
            "OMPI_COMM_WORLD_LOCAL_SIZE is not set",
        ),
        ({**MPICH, "PMI_RANK": ""}, "PMI_RANK='' is not an integer"),
        ({**SAGEMAKER, "SM_HOSTS": "algo-1"}, "SM_HOSTS='algo-1' is not a JSON list of host"),
        ({**SAGEMAKER, "SM_HOSTS": "[]"}, "SM_HOSTS='[]' is not a JSON list of host names"),
        ({**SAGEMAKER, "SM_HOSTS": '{"a": 1}'}, "SM_HOSTS='{\"a\": 1}' is not a JSON list"),
        (
            {**SAGEMAKER, "SM_CURRENT_HOST": "algo-3"},
            "SM_CURRENT_HOST='algo-3' is not one of SM_HOSTS=['algo-1', 'algo-2']",
        ),
        ({**SAGEMAKER, "SM_NUM_GPUS": "four"}, "SM_NUM_GPUS='four' is not an integer"),
        ({"MASTER_PORT": "nope"}, "MASTER_PORT='nope' is not an integer"),
    ],
)
def test_malformed_values(environ: dict[str, str], expected: str) -> None:
    with pytest.raises(EnvError) as error:
        DistEnv.detect(environ)
    assert expected in str(error.value)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {**SLURM, "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"},
            "RANK=3 is out of range for WORLD_SIZE=2 (from slurm)",
        ),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, "LOCAL_RANK=4 is out of range for LOCAL_WORLD_SIZE=4 (from torchrun)"),
        ({**TORCHRUN, "GROUP_RANK": "2"}, "NODE_RANK=2 is out of range for NNODES=2 (from torchrun)"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "16"}, "LOCAL_WORLD_SIZE=16 is larger than WORLD_SIZE=8 (from torchrun)"),
        (
            {**TORCHRUN, "MASTER_PORT": "70000"},
            "MASTER_PORT=70000 is not a TCP port (expected 1 to 65535) (from torchrun)",
        ),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1 (from torchrun)"),
        ({**SAGEMAKER, "LOCAL_RANK": "4"}, "LOCAL_RANK=4 is out of range for LOCAL_WORLD_SIZE=4 (from sagemaker)"),
        ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 must be at least 1 (from mpi)"),
    ],
)
def test_inconsistent_numbers(environ: dict[str, str], message: str) -> None:
    with pytest.raises(EnvError) as error:
        DistEnv.detect(environ)
    assert str(error.value) == message


def test_construction_validates() -> None:
    expected = r"^RANK=3 is out of range for WORLD_SIZE=2 \(from single\)$"
    with pytest.raises(EnvError, match=expected):
        DistEnv(rank=3, world_size=2)
    with pytest.raises(EnvError, match="MASTER_ADDR is empty"):
        DistEnv(master_addr="")
    with pytest.raises(EnvError, match="NODE_RANK=-1"):
        DistEnv(node_rank=-1)
    assert isinstance(EnvError("x"), ValueError)


def test_frozen_and_properties() -> None:
    found = DistEnv.detect(TORCHRUN)
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.rank = 0  # type: ignore[misc]
    assert (found.is_distributed, found.is_main) == (True, False)
    assert DistEnv(world_size=2).is_main


def test_torch_env() -> None:
    assert DistEnv.detect(SLURM).torch_env() == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "node07",
        "MASTER_PORT": "18456",
    }


@pytest.mark.parametrize(
    "environ",
    [
        TORCHRUN,
        SLURM,
        {**OPENMPI, "MASTER_ADDR": "a"},
        MPICH,
        SAGEMAKER,
        {},
        PYTORCHJOB,
        {
            "SLURM_PROCID": "6",
            "SLURM_NTASKS": "7",
            "SLURM_NODEID": "3",
            "SLURM_NNODES": "4",
            "SLURM_TASKS_PER_NODE": "2(x3),1",
            "SLURM_NODELIST": "n[1-4]",
        },
    ],
    ids=["torchrun", "slurm", "openmpi", "mpich", "sagemaker", "single", "pytorchjob", "slurm-uneven"],
)
def test_torch_env_round_trip(environ: dict[str, str]) -> None:
    found = DistEnv.detect(environ)
    assert DistEnv.detect(found.torch_env()) == dataclasses.replace(found, source="torchrun")


def test_import_does_not_load_torch() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    code = "import sys, torchfleet.env; sys.exit('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(src)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr or "importing torchfleet.env loaded torch"


def test_lines_dropped_from_stderr_are_only_those_named(capfd):
    """What c10d writes to file descriptor 2 from C++ while torchfleet takes its lookup warning: that line is
    dropped, every other line (a real warning) is printed after the block, and what came before stays first."""
    import os
    import sys

    from torchfleet.env.name_lookup import NOISE, dropping_lines

    print("before", file=sys.stderr)
    with dropping_lines(NOISE):
        os.write(2, f"[W1126 socket.cpp:207] {NOISE}. err=-3\n".encode())
        os.write(2, b"[W1126 ProcessGroupGloo.cpp:1] Warning: a real one\n")
    assert capfd.readouterr().err == "before\n[W1126 ProcessGroupGloo.cpp:1] Warning: a real one\n"
