"""Which torch.distributed backend to use here, and why.

`probe_hardware()` looks at this host once; `choose_backend(hw)` is a pure
function of what it found, so every hardware case can be tested with a fake
`Hardware`. The rule is PyTorch's own published rule of thumb:
https://pytorch.org/docs/stable/distributed.html#which-backend-to-use
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torchfleet import netif
from torchfleet.errors import UsageError

BACKENDS = ("gloo", "nccl", "mpi")
CHOICES = ("auto",) + BACKENDS

INFINIBAND_SYSFS = Path("/sys/class/infiniband")


class BackendError(UsageError):
    """A backend that is unknown, not built into this torch, or unable to work here.

    A UsageError (hence a ValueError): the CLI shows its one sentence and exits 2.
    """


@dataclass(frozen=True)
class Hardware:
    gpus: int  # CUDA devices visible to this process
    gpu_names: tuple[str, ...]
    gpu_memory_bytes: tuple[int, ...]
    infiniband: bool  # an InfiniBand HCA is present (/sys/class/infiniband has entries)
    ip_over_ib: bool  # an InfiniBand network interface (e.g. ib0) is up with an address
    built: frozenset[str]  # backends this torch build has; whether they can work is decided later


def _probe_gpus() -> tuple[tuple[str, ...], tuple[int, ...]]:
    import torch

    # is_available() first: device_count() alone can report devices a broken driver cannot use.
    if not torch.cuda.is_available():
        return (), ()
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return tuple(p.name for p in props), tuple(int(p.total_memory) for p in props)


def _probe_built() -> frozenset[str]:
    import torch.distributed as dist

    if not dist.is_available():  # e.g. some macOS or mobile builds
        return frozenset()
    checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
    return frozenset(name for name, check in checks.items() if check())


def _has_infiniband() -> bool:
    try:
        return any(INFINIBAND_SYSFS.iterdir())
    except OSError:
        return False


def _has_ip_over_ib() -> bool:
    return any(i.kind == "infiniband" and i.is_up and i.addresses for i in netif.list_interfaces())


def probe_hardware() -> Hardware:
    """What this host has: GPUs (through torch.cuda), InfiniBand (through /sys), built backends."""
    names, memory = _probe_gpus()
    return Hardware(
        gpus=len(names),
        gpu_names=names,
        gpu_memory_bytes=memory,
        infiniband=_has_infiniband(),
        ip_over_ib=_has_ip_over_ib(),
        built=_probe_built(),
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# Why a build may lack a backend, and what to use instead, for explicit requests.
_NOT_BUILT = {
    "gloo": "this PyTorch build has no Gloo backend; use nccl for GPUs or mpi if it is built",
    "nccl": "this PyTorch build has no NCCL backend (it is only included in CUDA builds on Linux); use gloo",
    "mpi": "this PyTorch build has no MPI backend (it is only included when PyTorch is built "
    "from source on a host with MPI installed); use gloo for CPUs or nccl for GPUs",
}


def _check_explicit(hw: Hardware, name: str, local_procs: int) -> None:
    """Raise BackendError if an explicitly requested backend cannot work here."""
    if name not in hw.built:
        raise BackendError(f"--backend {name}: {_NOT_BUILT[name]}")
    if name == "nccl" and hw.gpus == 0:
        raise BackendError("--backend nccl: nccl needs a CUDA GPU and none is visible; use gloo")
    if name == "nccl" and local_procs > hw.gpus:
        raise BackendError(
            f"--backend nccl: {local_procs} processes on this host would share"
            f" {_plural(hw.gpus, 'GPU')}, and NCCL needs a GPU of its own for each process;"
            f" start at most {hw.gpus} per host (-n {hw.gpus}) or use gloo"
        )


def shares_gpus(hw: Hardware, local_procs: int) -> bool:
    """More processes on this host than GPUs: some processes share a GPU, which NCCL refuses."""
    return 0 < hw.gpus < local_procs


def shared_gpus_refusal(strategy: str, local_procs: int, gpus: int) -> str:
    """Why `strategy` cannot run with processes sharing GPUs (only ddp can): one sentence for Fleet to raise."""
    return (
        f"{strategy} on {local_procs} processes sharing {gpus} GPU(s) needs"
        " collectives that Gloo does not run on GPU tensors (it all-reduces and broadcasts"
        f" only), and NCCL needs a GPU of its own for each process; start at most {gpus}"
        " process(es) per host, use ddp, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on"
        " CPU cores"
    )


def _choose_for_gpus(hw: Hardware, local_procs: int) -> tuple[str, str]:
    found = f"found {_plural(hw.gpus, 'CUDA GPU')}"
    if shares_gpus(hw, local_procs):
        # NCCL stops at init ("Duplicate GPU detected") when two ranks hold one device.
        return "gloo", (
            f"{found} for {local_procs} processes on this host; NCCL needs a GPU of its own for each"
            " process, so they share the GPUs over Gloo, which all-reduces GPU tensors (only slower)"
        )
    if "nccl" not in hw.built:
        # The docs name Gloo as NCCL's fallback for GPUs: it works, only slower.
        return "gloo", (f"{found} but this PyTorch build has no NCCL; Gloo handles GPU tensors too, only slower")
    if hw.infiniband:
        return "nccl", (f"{found} with InfiniBand; NCCL is the only backend that supports InfiniBand and GPUDirect")
    return "nccl", f"{found}; NCCL is PyTorch's fastest backend for GPU training"


def _choose_for_cpus(hw: Hardware) -> tuple[str, str]:
    base = "no GPU found; Gloo is PyTorch's backend for CPU tensors"
    # Gloo talks TCP: on InfiniBand it needs IP-over-IB, otherwise MPI uses the fabric directly.
    needs_mpi = hw.infiniband and not hw.ip_over_ib
    if needs_mpi and "mpi" in hw.built:
        return "mpi", (
            "no GPU found and InfiniBand has no IP-over-IB, so MPI, which uses InfiniBand directly, is faster than Gloo"
        )
    if needs_mpi:
        return "gloo", (
            f"{base} (MPI would be better on InfiniBand without IP-over-IB, but it needs "
            "PyTorch built from source on a host with MPI)"
        )
    if hw.infiniband:
        return "gloo", f"{base}, and it runs over IP-over-InfiniBand here"
    return "gloo", base


def choose_backend(hw: Hardware, requested: str = "auto", local_procs: int = 1) -> tuple[str, str]:
    """The backend for this hardware as (name, reason); `requested` may force one.

    `local_procs`: the processes of the job on this host (LOCAL_WORLD_SIZE).
    """
    name = requested.strip().lower()
    if name not in CHOICES:
        raise BackendError(f"unknown backend {requested!r}; choose one of {', '.join(CHOICES)}")
    if name != "auto":
        _check_explicit(hw, name, local_procs)
        return name, "chosen explicitly"
    name, reason = _choose_for_gpus(hw, local_procs) if hw.gpus else _choose_for_cpus(hw)
    if name not in hw.built:
        raise BackendError(
            f"this PyTorch build has no {name} backend, which this host needs ({reason}); "
            "install an official PyTorch build, which includes gloo"
        )
    return name, reason


def choose_socket_interface(nnodes: int, master_addr: str) -> None:
    """Across machines, tell Gloo and NCCL the interface that routes to the master.

    Unless told, they advertise the address this host's name resolves to,
    and where that is 127.0.0.1 (a common /etc/hosts line) peers on other
    machines never connect. srun, mpirun and SageMaker start the script
    without torchfleet's launcher, so the choice is made here; a user's own
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME wins.
    """
    if nnodes < 2:
        return
    found = netif.interface_for(master_addr)
    if found is not None and not found.is_loopback:
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if not os.environ.get(key):  # an empty value counts as unset, as Gloo reads it
                os.environ[key] = found.name
