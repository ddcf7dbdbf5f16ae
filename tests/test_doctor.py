"""doctor: the report is complete and JSON-able, the rules match the hardware, it renders."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from torchfleet.backend import Hardware
from torchfleet.doctor import collect_report, mpi_sentence, render_report, strategy_availability
from torchfleet.strategies import registry

KEYS = {
    "python",
    "torch",
    "torchfleet",
    "cpu_cores",
    "gpus",
    "infiniband",
    "ip_over_ib",
    "backends_built",
    "mpirun",
    "cluster",
    "interfaces",
    "backend",
    "strategies",
    "fault_tolerance",
}
CPU_HOST = Hardware(0, (), (), False, False, frozenset({"gloo"}))


def gpu_host(gpus: int) -> Hardware:
    return Hardware(gpus, ("NVIDIA A100",) * gpus, (40 * 2**30,) * gpus, False, False, frozenset({"gloo", "nccl"}))


def by_name(hw: Hardware, cores: int) -> dict[str, dict]:
    return {s["name"]: s for s in strategy_availability(hw, cores)}


@pytest.fixture(scope="module")
def report() -> dict:
    return collect_report(environ={})


def test_report_is_json_and_complete(report: dict) -> None:
    assert json.loads(json.dumps(report)) == report
    assert set(report) == KEYS
    assert set(report["backend"]) == {"name", "reason"}
    assert set(report["backends_built"]) == {"gloo", "nccl", "mpi"}
    assert report["cpu_cores"]["usable"] >= 1


@pytest.mark.timeout(180)  # 36 s of 60 in CI (30 Nov)
def test_doctor_says_mpi_works_only_where_it_finds_open_mpis_mpirun(tmp_path) -> None:
    """doctor on a PATH without mpirun, with another MPI's, and with Open MPI's (scripts that answer
    --version as each does): only the last says `mpirun -np N` works."""
    import sys

    from helpers import clean_env, run

    said = {}
    for name, version in (("none", None), ("mpich", "HYDRA build details:"), ("openmpi", "mpirun (Open MPI) 4.1.4")):
        folder = tmp_path / name
        folder.mkdir()
        if version:
            (folder / "mpirun").write_text(f"#!/bin/sh\necho '{version}'\n")
            (folder / "mpirun").chmod(0o755)
        env = clean_env(PATH=str(folder))  # the folder alone: /bin holds Open MPI's mpirun where it is installed
        done = run([sys.executable, "-m", "torchfleet", "doctor", "--json"], env=env, timeout=150)
        assert done.returncode == 0, done.stderr
        said[name] = json.loads(done.stdout)["mpirun"]
    assert said["none"] == {"path": None, "version": None, "open_mpi": False}
    assert said["mpich"]["path"].endswith("mpich/mpirun") and not said["mpich"]["open_mpi"]
    assert said["openmpi"] == {
        "path": str(tmp_path / "openmpi" / "mpirun"),
        "version": "mpirun (Open MPI) 4.1.4",
        "open_mpi": True,
    }
    base = {"backends_built": {"mpi": False}}
    assert mpi_sentence({**base, "mpirun": said["none"]}).startswith("no mpirun on PATH, so `mpirun -np N")
    assert "works" not in mpi_sentence({**base, "mpirun": said["none"]})
    assert "is not Open MPI's (it says 'HYDRA build details:')" in mpi_sentence({**base, "mpirun": said["mpich"]})
    assert "`mpirun -np N python script.py` works" in mpi_sentence({**base, "mpirun": said["openmpi"]})


def test_report_on_this_machine(report: dict) -> None:
    assert report["gpus"] == []
    assert report["backend"]["name"] == "gloo"
    assert "lo" in [i["name"] for i in report["interfaces"]]
    assert "error" in report["cluster"] or "world_size" in report["cluster"]


def test_report_says_whether_per_step_fault_tolerance_can_run(report: dict, monkeypatch) -> None:
    from torchfleet import doctor
    from torchfleet.replica_groups import torchft_setup

    installed = torchft_setup.version()
    assert report["fault_tolerance"]["torchft"] == installed
    assert report["fault_tolerance"]["available"] == (installed is not None)
    monkeypatch.setattr(torchft_setup, "version", lambda: None)  # as where torchft is not installed
    missing = doctor._fault_tolerance()
    assert missing == {
        "torchft": None,
        "available": False,
        "why": "torchft is not installed; pip install 'torchfleet[ft]' (or pip install torchft)",
    }
    out = io.StringIO()
    render_report({**report, "fault_tolerance": missing}, Console(file=out, width=200))
    assert "Per-step fault tolerance: no: torchft is not installed; pip install 'torchfleet[ft]'" in out.getvalue()


def test_report_lists_every_strategy_and_dp_needs_gpus(report: dict) -> None:
    strategies = {s["name"]: s for s in report["strategies"]}
    assert list(strategies) == list(registry.names()) and len(registry.names()) == 16
    assert strategies["dp"]["available"] is False
    assert "GPU" in strategies["dp"]["why"]


def test_report_uses_given_hardware() -> None:
    report = collect_report(gpu_host(2), environ={})
    assert [g["index"] for g in report["gpus"]] == [0, 1]
    assert report["gpus"][0] == {"index": 0, "name": "NVIDIA A100", "memory_bytes": 40 * 2**30}
    assert report["backend"]["name"] == "nccl"


def test_cpu_host_rules() -> None:
    found = by_name(CPU_HOST, cores=2)
    assert {n: s["available"] for n, s in found.items()} == {
        "serial": True,
        "hogwild": True,
        "dp": False,
        "mp": True,
        "ddp": True,
        "fsdp": True,
        "hsdp": True,
        "pipeline": True,
        "ddp+pipeline": True,
        "fsdp+pipeline": True,
        "tp": True,
        "fsdp+tp": True,
        "ep": True,
        "fsdp+ep": True,
        "diloco": True,
        "localsgd": True,
    }
    assert "pays only where the link between machines is slow" in found["diloco"]["why"]
    assert "CPU only" in found["mp"]["why"] and ">= 2 GPUs" in found["mp"]["why"]
    assert "0 visible" in found["dp"]["why"]
    assert "gloo" in found["ddp"]["why"]
    for name in ("hsdp", "ddp+pipeline", "fsdp+pipeline", "fsdp+tp"):  # 2 x 2 processes on 2 cores
        assert "oversubscribe" in found[name]["why"]


def test_single_core_host_rules() -> None:
    found = by_name(CPU_HOST, cores=1)
    assert found["serial"]["available"]
    assert not found["hogwild"]["available"] and "2 CPU cores" in found["hogwild"]["why"]
    for name in ("ddp", "fsdp", "pipeline"):
        assert not found[name]["available"] and "needs 2 processes" in found[name]["why"]
    # The 2-D layout may still be checked on CPU, slowly.
    assert found["ddp+pipeline"]["available"]


def test_multi_gpu_host_rules() -> None:
    found = by_name(gpu_host(8), cores=4)
    assert all(s["available"] for s in found.values())
    assert "8 GPUs" in found["dp"]["why"] and "GPU" in found["ddp+pipeline"]["why"]
    assert "oversubscribe" not in found["ddp+pipeline"]["why"]


def test_one_gpu_host_offers_only_what_runs_on_processes_sharing_it() -> None:
    # As Fleet does: 2 processes on 1 GPU share it over Gloo, which runs ddp's all-reduce and
    # refuses the collectives of the others; the 2 x 2 presets share 2 GPUs the same way.
    for gpus, need in ((1, 2), (2, 4)):
        found = by_name(gpu_host(gpus), cores=16)
        offered = {n for n, s in found.items() if s["available"]}
        assert offered == (
            {"serial", "hogwild", "mp", "ddp"}
            | ({"dp", "fsdp", "pipeline", "tp", "ep", "fsdp+ep", "diloco", "localsgd"} if gpus == 2 else set())
        )
        if gpus == 1:
            assert "2 processes share the one GPU over Gloo" in found["ddp"]["why"]
        refused = found["fsdp" if gpus == 1 else "hsdp"]["why"]
        assert refused.startswith(f"needs {need} GPUs, one per process (NCCL)") and "CUDA_VISIBLE_DEVICES=" in refused


def test_render_report_shows_the_backend_and_reason(report: dict) -> None:
    buffer = io.StringIO()
    render_report(report, Console(file=buffer))
    text = " ".join(buffer.getvalue().split())  # undo the console's line wrapping
    assert report["backend"]["name"] in text
    assert report["backend"]["reason"] in text
    assert "ddp+pipeline" in text and "lo" in text


def test_cluster_is_detected_from_the_given_environment() -> None:
    environ = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    cluster = collect_report(CPU_HOST, environ=environ)["cluster"]
    assert (cluster["rank"], cluster["world_size"], cluster["master_port"]) == (1, 2, 1234)


def test_bad_cluster_environment_is_reported_not_raised() -> None:
    report = collect_report(CPU_HOST, environ={"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert "RANK='x'" in report["cluster"]["error"]
    buffer = io.StringIO()
    render_report(report, Console(file=buffer, width=200))
    assert "RANK='x'" in buffer.getvalue()
