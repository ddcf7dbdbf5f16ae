"""How busy the machine is apart from the work being timed: other processes' CPU, the load average, the CPU
clock, other processes on the GPUs. bench states it and flags what it measured beside a load; the straggler
verdicts tell a busy machine from a slow rank with it.

Other processes' CPU is measured, not guessed from the load average (which counts our own processes and
trails by a minute): the busy time of the CPUs from /proc/stat over a span, less the CPU time the timed
processes report for the same span (`time.process_time`, every thread). What is left is what others took,
in cores: `others_cores = (busy CPU-seconds - ours) / wall seconds`. /proc/stat counts in ticks (10 ms on
Linux), so a span of a second on 2 cores reads to about 1%. Steal time counts as busy: a hypervisor gave
the core to someone else. Linux only; elsewhere the figures are None and nothing is flagged for them.

A process's wait for a CPU is its run delay (/proc/self/schedstat, second field, in ns): the time its main
thread was ready to run and no CPU was free for it. A rank whose core others took waits there; an idle
machine's ranks hardly ever do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# The machine is busy when other processes keep more than this share of the usable cores busy, and at least
# half a core: on 2 cores, one other busy process (0.5 of them) is busy; a browser or an editor (~0.05) is not.
BUSY_SHARE = 0.25
BUSY_FLOOR_CORES = 0.5
SAMPLE_S = 1.0  # the sample taken before a benchmark starts
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal; idle and iowait are the rest (3, 4)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return set(range(os.cpu_count() or 1))


def cpu_busy_seconds(cpus: set[int] | None = None) -> float | None:
    """Busy CPU-seconds since boot over `cpus` (default: the usable ones), from /proc/stat; None elsewhere."""
    cpus = usable_cpus() if cpus is None else cpus
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def run_delay_seconds() -> float | None:
    """Seconds this process's main thread has waited, ready to run, for a CPU (None where unreadable)."""
    try:
        return int(Path("/proc/self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class Span:
    """The CPUs' busy seconds and the wall clock from `Span()` to `end()`: with the timed processes' own CPU
    seconds over it, what other processes took (`others_cores`)."""

    def __init__(self, cpus: set[int] | None = None) -> None:
        self.cpus = usable_cpus() if cpus is None else cpus
        self._busy, self._wall, self._cpu = cpu_busy_seconds(self.cpus), time.perf_counter(), time.process_time()
        self.busy_s: float | None = None
        self.wall_s = 0.0
        self.own_cpu_s = 0.0  # this process's

    def end(self) -> Span:
        busy = cpu_busy_seconds(self.cpus)
        self.wall_s = time.perf_counter() - self._wall
        self.own_cpu_s = time.process_time() - self._cpu
        self.busy_s = None if busy is None or self._busy is None else busy - self._busy
        return self

    def others_cores(self, ours_cpu_s: float) -> float | None:
        """Cores other processes kept busy over the span, given the CPU seconds of all of ours in it."""
        if self.busy_s is None or self.wall_s <= 0:
            return None
        return max(0.0, (self.busy_s - ours_cpu_s) / self.wall_s)


def busy_cores(cores: int) -> float:
    """Other processes' cores from which a machine of `cores` usable cores counts as busy."""
    return max(BUSY_FLOOR_CORES, BUSY_SHARE * cores)


def cpu_mhz() -> dict:
    """The CPUs' clock now and at most, in MHz, where the kernel shows it (cpufreq, else /proc/cpuinfo's
    figure, which some virtual machines fix at the nominal clock); {} where neither is readable."""
    now, top = [], []
    for cpu in sorted(usable_cpus()):
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq")
        try:
            now.append(int((base / "scaling_cur_freq").read_text()) / 1e3)
            top.append(int((base / "cpuinfo_max_freq").read_text()) / 1e3)
        except (OSError, ValueError):
            continue
    if not now:
        try:
            info = Path("/proc/cpuinfo").read_text().splitlines()
        except OSError:
            return {}
        now = [float(line.split(":")[1]) for line in info if line.startswith("cpu MHz")]
    if not now:
        return {}
    found = {"mhz": round(sum(now) / len(now)), "source": "cpufreq" if top else "/proc/cpuinfo"}
    if top:
        found["max_mhz"] = round(max(top))
    return found


def gpu_processes() -> list[dict] | None:
    """Other processes on this machine's NVIDIA GPUs (pid, name, MiB), from nvidia-smi; None without it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) != os.getpid():
            found.append({"pid": int(parts[0]), "name": parts[1], "mib": int(parts[2]) if parts[2].isdigit() else None})
    return found


@dataclass(frozen=True)
class MachineState:
    """The machine as a run found it: other processes' cores over a sample, the load average, the clock."""

    cores: int  # usable
    others_cores: float | None  # over `sample_s`, while this process did nothing
    sample_s: float
    load_average: tuple[float, float, float] | None
    cpu: dict
    gpu_processes: list[dict] | None  # None: not looked for (no GPU, or no nvidia-smi)

    @property
    def busy(self) -> bool:
        return bool(self.others_cores is not None and self.others_cores >= busy_cores(self.cores)) or bool(
            self.gpu_processes
        )

    def line(self) -> str:
        """One sentence: the figures, and whether they make the machine busy."""
        parts = []
        if self.others_cores is not None:
            parts.append(f"other processes kept {self.others_cores:.1f} of {self.cores} usable cores busy")
        if self.load_average is not None:
            parts.append(f"load average {self.load_average[0]:.1f}")
        if self.cpu.get("mhz"):
            top = f" of {self.cpu['max_mhz']:,}" if self.cpu.get("max_mhz") else ""
            parts.append(f"CPU clock {self.cpu['mhz']:,}{top} MHz")
        if self.gpu_processes:
            parts.append(f"{len(self.gpu_processes)} other process(es) on the GPUs")
        figures = "; ".join(parts) or "no figures readable here"
        if self.busy:
            return f"the machine is busy: {figures} (over {self.sample_s:g} s before the first measurement)"
        return f"the machine is idle enough: {figures}"

    def row(self) -> dict:
        return {
            "cores": self.cores,
            "others_cores": self.others_cores,
            "sample_s": self.sample_s,
            "load_average": list(self.load_average) if self.load_average else None,
            "cpu": self.cpu,
            "gpu_processes": self.gpu_processes,
            "busy": self.busy,
            "busy_from_cores": busy_cores(self.cores),
        }


def measure(sample_s: float = SAMPLE_S, gpus: int = 0) -> MachineState:
    """The machine's state now: `sample_s` of other processes' CPU (this process sleeps through it)."""
    span = Span()
    time.sleep(sample_s)
    span.end()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return MachineState(
        cores=len(span.cpus),
        others_cores=span.others_cores(span.own_cpu_s),
        sample_s=sample_s,
        load_average=load,
        cpu=cpu_mhz(),
        gpu_processes=gpu_processes() if gpus else None,
    )
