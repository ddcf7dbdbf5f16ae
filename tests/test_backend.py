"""Backend advice for each hardware case, from fake Hardware values; plus the real probes."""

from __future__ import annotations

import pytest

from torchfleet import netif
from torchfleet.backend import BackendError, Hardware, choose_backend, probe_hardware
from torchfleet.errors import UsageError

CPU_BUILD = frozenset({"gloo"})
CUDA_BUILD = frozenset({"gloo", "nccl"})
MPI_BUILD = frozenset({"gloo", "mpi"})


def hardware(
    gpus: int = 0, infiniband: bool = False, ip_over_ib: bool = False, built: frozenset[str] = CUDA_BUILD
) -> Hardware:
    return Hardware(
        gpus=gpus,
        gpu_names=("NVIDIA H100",) * gpus,
        gpu_memory_bytes=(80 * 2**30,) * gpus,
        infiniband=infiniband,
        ip_over_ib=ip_over_ib,
        built=built,
    )


# ---- automatic choice -----------------------------------------------------------------


def test_cpu_only_uses_gloo() -> None:
    name, reason = choose_backend(hardware(built=CPU_BUILD))
    assert name == "gloo"
    assert reason == "no GPU found; Gloo is PyTorch's backend for CPU tensors"


def test_cpu_with_infiniband_without_ipoib_uses_mpi_when_built() -> None:
    name, reason = choose_backend(hardware(infiniband=True, built=MPI_BUILD))
    assert name == "mpi"
    assert "InfiniBand" in reason and "IP-over-IB" in reason


def test_cpu_with_infiniband_without_ipoib_and_no_mpi_build_uses_gloo_and_says_so() -> None:
    name, reason = choose_backend(hardware(infiniband=True, built=CUDA_BUILD))
    assert name == "gloo"
    assert reason.startswith("no GPU found; Gloo is PyTorch's backend for CPU tensors")
    assert "MPI would be better" in reason and "from source" in reason


def test_cpu_with_ip_over_infiniband_uses_gloo_even_with_mpi() -> None:
    name, reason = choose_backend(hardware(infiniband=True, ip_over_ib=True, built=MPI_BUILD))
    assert name == "gloo"
    assert "IP-over-InfiniBand" in reason


def test_cpu_with_mpi_build_but_ethernet_uses_gloo() -> None:
    assert choose_backend(hardware(built=MPI_BUILD))[0] == "gloo"


@pytest.mark.parametrize("gpus, words", [(1, "1 CUDA GPU;"), (8, "8 CUDA GPUs")])
def test_gpus_use_nccl(gpus: int, words: str) -> None:
    name, reason = choose_backend(hardware(gpus=gpus))
    assert name == "nccl"
    assert words in reason and "NCCL" in reason
    assert "InfiniBand" not in reason


def test_gpus_with_infiniband_use_nccl_for_gpudirect() -> None:
    name, reason = choose_backend(hardware(gpus=8, infiniband=True, built=frozenset({"gloo", "nccl", "mpi"})))
    assert name == "nccl"
    assert "8 CUDA GPUs" in reason and "InfiniBand" in reason and "GPUDirect" in reason


def test_gpus_without_nccl_build_fall_back_to_gloo() -> None:
    name, reason = choose_backend(hardware(gpus=2, built=CPU_BUILD))
    assert name == "gloo"
    assert "2 CUDA GPUs" in reason and "no NCCL" in reason


@pytest.mark.parametrize("gpus, procs", [(1, 2), (2, 4)])
def test_more_processes_than_gpus_share_them_over_gloo(gpus: int, procs: int) -> None:
    name, reason = choose_backend(hardware(gpus=gpus), local_procs=procs)
    assert name == "gloo"
    assert f"for {procs} processes on this host" in reason and "a GPU of its own" in reason
    assert choose_backend(hardware(gpus=gpus), local_procs=gpus)[0] == "nccl"  # one each: NCCL


def test_nccl_asked_for_more_processes_than_gpus_says_how_many_fit() -> None:
    with pytest.raises(
        BackendError,
        match=r"--backend nccl: 2 processes on this host would share 1 GPU,"
        r" .* start at most 1 per host \(-n 1\) or use gloo",
    ):
        choose_backend(hardware(gpus=1), "nccl", local_procs=2)


def test_no_usable_backend_built_is_an_error() -> None:
    with pytest.raises(BackendError, match="no gloo backend"):
        choose_backend(hardware(built=frozenset()))


# ---- explicit requests ----------------------------------------------------------------


@pytest.mark.parametrize(
    "hw, requested",
    [
        (hardware(built=CPU_BUILD), "gloo"),
        (hardware(gpus=2), "gloo"),
        (hardware(gpus=2), "nccl"),
        (hardware(built=MPI_BUILD), "mpi"),
        (hardware(gpus=1), "NCCL"),  # case does not matter
    ],
)
def test_valid_explicit_choice_is_honoured(hw: Hardware, requested: str) -> None:
    assert choose_backend(hw, requested) == (requested.lower(), "chosen explicitly")


def test_auto_is_the_default() -> None:
    hw = hardware(gpus=4)
    assert choose_backend(hw, "auto") == choose_backend(hw)


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(BackendError) as caught:
        choose_backend(hardware(), "xyz")
    assert str(caught.value) == "unknown backend 'xyz'; choose one of auto, gloo, nccl, mpi"


def test_mpi_not_built_says_why_and_what_to_use() -> None:
    with pytest.raises(BackendError) as caught:
        choose_backend(hardware(built=CUDA_BUILD), "mpi")
    message = str(caught.value)
    assert message.startswith("--backend mpi: this PyTorch build has no MPI backend")
    assert "built from source" in message and "use gloo for CPUs or nccl for GPUs" in message


def test_nccl_without_gpu_says_use_gloo() -> None:
    with pytest.raises(BackendError) as caught:
        choose_backend(hardware(gpus=0, built=CUDA_BUILD), "nccl")
    assert "nccl needs a CUDA GPU and none is visible; use gloo" in str(caught.value)


def test_nccl_not_built_says_use_gloo() -> None:
    with pytest.raises(BackendError, match="no NCCL backend.*use gloo"):
        choose_backend(hardware(gpus=2, built=CPU_BUILD), "nccl")


def test_backend_error_is_a_usage_error() -> None:
    # The CLI turns UsageError into one sentence and exit status 2.
    assert issubclass(BackendError, UsageError) and issubclass(BackendError, ValueError)


# ---- the real host --------------------------------------------------------------------


def test_probe_hardware_on_this_machine() -> None:
    hw = probe_hardware()
    assert hw.gpus == len(hw.gpu_names) == len(hw.gpu_memory_bytes)
    assert "gloo" in hw.built
    assert hw.built <= {"gloo", "nccl", "mpi"}


def test_probe_hardware_finds_no_gpu_on_a_cpu_host() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert probe_hardware().gpus == 0


def test_list_interfaces_has_loopback() -> None:
    lo = {i.name: i for i in netif.list_interfaces()}["lo"]
    assert "127.0.0.1" in lo.addresses
    assert lo.is_loopback and lo.is_up and lo.kind == "loopback"


def test_ioctl_fallback_agrees_on_loopback() -> None:
    lo = {i.name: i for i in netif._via_ioctl()}["lo"]
    assert "127.0.0.1" in lo.addresses and lo.is_loopback


@pytest.mark.parametrize("dest", ["127.0.0.1", "localhost", "127.0.0.2"])
def test_interface_for_loopback_is_lo(dest: str) -> None:
    found = netif.interface_for(dest)
    assert found is not None and found.name == "lo"


def test_interface_for_unresolvable_host_is_none() -> None:
    assert netif.interface_for("no-such-host.invalid") is None


@pytest.mark.parametrize(
    "gpus, cores, want",
    [
        (4, 16, ("ddp", 4)),  # one process per GPU
        (1, 16, ("serial", 1)),  # one GPU: two processes would take turns on it
        (0, 16, ("ddp", 2)),  # CPU cores, no GPU
        (0, 1, ("serial", 1)),
    ],
)
def test_auto_plans_processes_for_the_hardware(monkeypatch, gpus: int, cores: int, want: tuple) -> None:
    from torchfleet.train import processes

    monkeypatch.setattr(processes, "_gpus", lambda: gpus)
    monkeypatch.setattr(processes, "_cpu_cores", lambda: cores)
    strategy, nproc, why = processes.plan_processes("auto", None)
    assert (strategy, nproc) == want and why.startswith("strategy auto: ")
    assert processes.plan_processes("auto", 3)[:2] == ("ddp", 3)  # -n given: ddp on that many, whatever is here
