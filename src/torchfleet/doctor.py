"""`torchfleet doctor`: what this machine has, which backend, which strategies, and why.

`collect_report()` gathers everything into one JSON-serialisable dict (what
`torchfleet doctor --json` prints and a bug report can attach);
`render_report()` shows the same dict for a person. Nothing is decided twice:
the backend comes from `backend.choose_backend`, the cluster from `DistEnv.detect`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Callable, Mapping
from importlib import metadata

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torchfleet import netif, versions
from torchfleet.backend import BACKENDS, BackendError, Hardware, choose_backend, probe_hardware
from torchfleet.strategies import registry

Rule = Callable[[Hardware, int], tuple[bool, str]]


# ---- strategy availability: one small rule per strategy ---------------------------------


def _serial(hw: Hardware, cores: int) -> tuple[bool, str]:
    return True, "one process on one device: the baseline every strategy is compared with"


def _hogwild(hw: Hardware, cores: int) -> tuple[bool, str]:
    # Lock-free workers only overlap when each has a core of its own.
    if cores >= 2:
        return True, f"{cores} CPU cores for lock-free workers sharing the model in memory"
    return False, f"needs >= 2 CPU cores for its worker processes; {cores} usable"


def _dp(hw: Hardware, cores: int) -> tuple[bool, str]:
    if hw.gpus >= 2:
        return True, f"nn.DataParallel splits each batch across the {hw.gpus} GPUs"
    # It would still run on one device, but it would only add overhead to serial.
    return False, (
        f"nn.DataParallel splits the batch across GPUs; {hw.gpus} visible (it runs on one device but brings nothing)"
    )


def _mp(hw: Hardware, cores: int) -> tuple[bool, str]:
    if hw.gpus >= 2:
        return True, f"the model's parts are placed on {hw.gpus} GPUs"
    # Still worth running: it checks the split and the micro-batching on any host.
    where = "the CPU only (cpu,cpu)" if hw.gpus == 0 else "the one GPU (cuda:0,cuda:0)"
    return True, f"runs, but its stages share {where}; pays with >= 2 GPUs"


def _gpus(hw: Hardware) -> str:
    return "one GPU" if hw.gpus == 1 else f"{hw.gpus} GPUs"


def _world(need: int, oversubscribe: bool = False, shares_gpus: bool = False) -> Rule:
    """A rule for strategies that need a world of `need` processes.

    With GPUs, but fewer than `need`, the processes would share them over Gloo
    (Fleet does what backend.choose_backend says): only ddp's all-reduce runs
    there (`shares_gpus`), the others are refused, so they are not offered.
    """

    def rule(hw: Hardware, cores: int) -> tuple[bool, str]:
        if hw.gpus >= need:
            return True, f"{need} or more processes, one per GPU ({hw.gpus} GPUs)"
        if hw.gpus and shares_gpus:
            return True, (
                f"{need} processes share the {_gpus(hw)} over Gloo (NCCL needs a GPU for each); pays with {need} GPUs"
            )
        if hw.gpus:
            return False, (
                f"needs {need} GPUs, one per process (NCCL), and {_gpus(hw)} here; processes"
                " sharing a GPU run ddp only. CUDA_VISIBLE_DEVICES= runs it on the CPU cores"
            )
        if cores >= need:
            return True, f"{need} or more CPU processes with gloo ({cores} cores)"
        if oversubscribe:
            # Correct but slow: fine for checking a layout before renting the hardware.
            return True, (
                f"needs {need} processes; on CPU with gloo they oversubscribe the "
                f"{cores} core{'s' if cores != 1 else ''}"
            )
        return False, (
            f"needs {need} processes: {need} GPUs or {need} CPU cores; "
            f"found {hw.gpus} GPUs and {cores} usable core{'s' if cores != 1 else ''}"
        )

    return rule


def _meeting(hw: Hardware, cores: int) -> tuple[bool, str]:
    """diloco, localsgd: ddp's processes as replica groups under torchft, meeting every few steps."""
    from torchfleet.replica_groups import torchft_setup

    reason = torchft_setup.unavailable()
    if reason:
        return False, f"runs on torchft: {reason}"
    available, why = _world(2)(hw, cores)  # torchft's NCCL group between groups: a GPU each
    if not available:
        return available, why
    return True, (
        f"{why}; pays only where the link between machines is slow enough that ddp spends most of"
        " each step exchanging gradients: on one machine ddp is faster (docs/benchmarks/history.md)"
    )


# The strategies that are classes of their own, by what their preset says to check (registry.CHECKS);
# every preset of the mesh's degrees follows one rule.
_RULES: dict[str, Rule] = {"one device": _serial, "worker cores": _hogwild, "split batch": _dp, "placed stages": _mp}


def _rule(preset: registry.Preset) -> Rule:
    if preset.checks is not None:
        return _RULES[preset.checks]
    if preset.launch == "replica groups":
        return _meeting
    if not preset.mesh:
        return lambda hw, cores: (True, "runs in one process")  # a registered class of its own
    # Two dimensions of 2 on 2 CPU cores with gloo oversubscribe them: correct but slow. Only ddp's
    # all-reduce runs on GPUs that processes share over Gloo.
    need = preset.min_processes
    return _world(need, oversubscribe=need > 2, shares_gpus=preset.shares_gpus)


def strategy_availability(hw: Hardware, cpu_cores: int) -> list[dict]:
    """For every strategy: whether it can run here and why, as {"name","available","why"}."""
    result = []
    for preset in registry.presets().values():
        available, why = _rule(preset)(hw, cpu_cores)
        result.append({"name": preset.name, "available": available, "why": why})
    return result


# ---- collecting ---------------------------------------------------------------------------


def _torchfleet_version() -> str:
    try:
        return metadata.version("torchfleet")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def _torch_info() -> dict:
    import torch

    support, why = versions.standing()
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,  # None for CPU-only builds
        "debug": bool(torch.version.debug),
        "tested_range": versions.tested_range(),
        "support": support,  # supported, too old, newer than tested
        "support_note": why,
    }


def _cpu_cores() -> dict:
    total = os.cpu_count() or 1
    # Affinity is what this process may use (taskset, cgroups, Slurm's --cpus-per-task).
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    return {"total": total, "usable": usable}


def _plain(value: object) -> object:
    """A JSON-friendly copy of a scalar: enums, paths and the like become strings."""
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _cluster(environ: Mapping[str, str] | None) -> dict:
    from torchfleet.env import DistEnv, EnvError

    try:
        found = DistEnv.detect(environ)
    except EnvError as error:
        return {"error": str(error)}
    return {key: _plain(value) for key, value in dataclasses.asdict(found).items()}


def _backend(hw: Hardware) -> dict:
    try:
        name, reason = choose_backend(hw)
    except BackendError as error:
        return {"name": None, "reason": str(error)}
    return {"name": name, "reason": reason}


def _interfaces() -> list[dict]:
    return [{**dataclasses.asdict(i), "addresses": list(i.addresses)} for i in netif.list_interfaces()]


def _fault_tolerance() -> dict:
    """Whether --fault-tolerance step can run here: torchft installed, and loading with this torch."""
    from torchfleet.replica_groups import torchft_setup

    why = torchft_setup.unavailable()
    version = torchft_setup.version()
    return {
        "torchft": version,
        "available": why is None,
        "why": why or f"torchft {version} loads: --fault-tolerance step and torchfleet lighthouse can run here",
    }


def _mpirun() -> dict:
    """Where mpirun is and whether it is Open MPI's (torchfleet reads Open MPI's variables), from `mpirun
    --version`; path None when there is none on PATH."""
    import shutil
    import subprocess

    path = shutil.which("mpirun")
    if path is None:
        return {"path": None, "version": None, "open_mpi": False}
    try:
        said = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        first = (said.stdout or said.stderr).strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        first = []
    version = first[0] if first else None
    return {"path": path, "version": version, "open_mpi": bool(version and "Open MPI" in version)}


def collect_report(hw: Hardware | None = None, environ: Mapping[str, str] | None = None) -> dict:
    """Everything doctor knows about this host, as a JSON-serialisable dict."""
    hw = hw if hw is not None else probe_hardware()
    cores = _cpu_cores()
    gpus = zip(hw.gpu_names, hw.gpu_memory_bytes, strict=False)
    return {
        "python": platform.python_version(),
        "torch": _torch_info(),
        "torchfleet": _torchfleet_version(),
        "cpu_cores": cores,
        "gpus": [{"index": i, "name": name, "memory_bytes": memory} for i, (name, memory) in enumerate(gpus)],
        "infiniband": hw.infiniband,
        "ip_over_ib": hw.ip_over_ib,
        "backends_built": {name: name in hw.built for name in BACKENDS},
        "mpirun": _mpirun(),
        "cluster": _cluster(environ),
        "interfaces": _interfaces(),
        "backend": _backend(hw),
        "strategies": strategy_availability(hw, cores["usable"]),
        "fault_tolerance": _fault_tolerance(),
    }


# ---- rendering ----------------------------------------------------------------------------


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]no[/]"


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def _system_table(report: dict) -> Table:
    table = Table(title="System", show_header=False, title_justify="left")
    torch_info = report["torch"]
    cuda = f"CUDA {torch_info['cuda']}" if torch_info["cuda"] else "CPU-only build"
    debug = ", debug build" if torch_info["debug"] else ""
    cores = report["cpu_cores"]
    table.add_row("Python", escape(report["python"]))
    table.add_row("PyTorch", escape(f"{torch_info['version']} ({cuda}{debug}): {torch_info['support_note']}"))
    table.add_row("torchfleet", escape(report["torchfleet"]))
    table.add_row("CPU cores", f"{cores['usable']} usable of {cores['total']}")
    gpus = [f"{g['index']}: {g['name']}, {_gib(g['memory_bytes'])}" for g in report["gpus"]]
    table.add_row("GPUs", escape("\n".join(gpus)) if gpus else "none visible")
    built = report["backends_built"]
    table.add_row("Backends built", ", ".join(f"{n} {_yes(built[n])}" for n in built))
    return table


def _network_table(report: dict) -> Table:
    ib = f"InfiniBand {_yes(report['infiniband'])}, IP-over-IB {_yes(report['ip_over_ib'])}"
    table = Table(title=f"Network ({ib})", title_justify="left")
    for column in ("interface", "kind", "up", "addresses"):
        table.add_column(column)
    for i in report["interfaces"]:
        addresses = ", ".join(i["addresses"]) or "-"
        table.add_row(escape(i["name"]), i["kind"], _yes(i["is_up"]), escape(addresses))
    return table


def _cluster_table(report: dict) -> Table:
    table = Table(title="Cluster environment", show_header=False, title_justify="left")
    for key, value in report["cluster"].items():
        table.add_row(escape(key), escape(str(value)))
    return table


def _strategy_table(report: dict) -> Table:
    table = Table(title="Strategies", title_justify="left")
    for column in ("strategy", "here", "why"):
        table.add_column(column)
    for s in report["strategies"]:
        table.add_row(s["name"], _yes(s["available"]), escape(s["why"]))
    return table


def render_report(report: dict, console: Console) -> None:
    """Show a collect_report() dict as a few short tables and the backend advice."""
    console.print(_system_table(report))
    console.print(_network_table(report))
    console.print(_cluster_table(report))
    backend = report["backend"]
    name = backend["name"] or "none usable"
    console.print(f"[bold]Backend:[/] [cyan]{escape(name)}[/]: {escape(backend['reason'])}")
    console.print(f"[bold]MPI:[/] {escape(mpi_sentence(report))}")
    console.print(_strategy_table(report))
    ft = report["fault_tolerance"]
    console.print(f"[bold]Per-step fault tolerance:[/] {_yes(ft['available'])}: {escape(ft['why'])}")


def mpi_sentence(report: dict) -> str:
    """What doctor found of MPI: whether `mpirun -np N python script.py` can run here, and why."""
    found = report.get("mpirun") or {}
    backend = (
        " The MPI backend itself is built into this PyTorch."
        if report["backends_built"].get("mpi")
        else " The MPI backend itself needs PyTorch built from source on a host with MPI installed."
    )
    if not found.get("path"):
        return (
            "no mpirun on PATH, so `mpirun -np N python script.py` cannot run here; with Open MPI's (apt-get"
            " install openmpi-bin) it would, ranks from Open MPI's variables and Gloo carrying the tensors." + backend
        )
    if not found.get("open_mpi"):
        return (
            f"{found['path']} is not Open MPI's (it says {found.get('version')!r}); torchfleet reads Open MPI's"
            " variables, so use Open MPI's mpirun, or torchrun." + backend
        )
    return (
        f"{found['path']} ({found['version']}): `mpirun -np N python script.py` works, ranks from Open MPI's"
        " variables and Gloo carrying the tensors." + backend
    )


def print_doctor(json_out: bool = False) -> int:
    """The `torchfleet doctor` command: JSON or a readable report on stdout; exit code 0."""
    report = collect_report()
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        render_report(report, Console())
    return 0
