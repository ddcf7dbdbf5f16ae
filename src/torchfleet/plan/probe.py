"""Calibration: this machine's compute rate and local link, from short probes, cached per machine.

- Matrix multiply rate at each thread count from 1 to the usable cores: the
  best of a few 1024 x 1024 fp32 products (2 GFLOP each). The plan uses the
  ratio between thread counts, not the figure itself: a model's own rate comes
  from timing its step (profiler.py).
- Gloo all-reduce among N local processes (N = 2 and 4), started through the
  launcher as a job's processes are: a small message gives the per-message
  latency, a large one the bandwidth, fitted to the ring formula of comm.py.
  Processes beyond the cores share them, and so does Gloo's copying: the figure
  at 4 processes on 2 cores says so, which is why each N is probed.
- In the same processes: a send between two of them (a pipeline's hand-over),
  and the overhead of the strategies' own machinery per step, per fsdp unit,
  per tensor-parallel Linear and per DDP gradient tensor (overheads.py), timed
  with the real wrappers on a tiny model of known parts.
- Per model, when a plan first needs it: how much slower the model's step
  runs in N processes at once than in one (contention.py), for N = 2 and 4.

The cache is one JSON file per machine under $XDG_CACHE_HOME/torchfleet (or
~/.cache/torchfleet), keyed by host name, torch version and usable cores (any
of those changing gives other rates) and by torchfleet's version and a digest
of the probes' own code (a changed probe measures something else, so its old
figures are not read). `--reprobe` measures again.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchfleet import installed
from torchfleet.plan.comm import Link

PROBE_PROCESSES = (2, 4)
SMALL_BYTES = 4 * 1024
LARGE_BYTES = 16 * 2**20
SCHEMA = "torchfleet-plan-calibration/6"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass
class Calibration:
    host: str
    torch: str
    cores: int
    matmul_flops: dict[int, float] = field(default_factory=dict)  # threads -> FLOP/s
    links: dict[int, Link] = field(default_factory=dict)  # local processes -> Gloo link among them
    p2p: dict[int, Link] = field(default_factory=dict)  # local processes -> one send/recv between two of them
    overheads: dict[int, dict[str, float]] = field(default_factory=dict)  # local processes -> overheads.measure()
    probed_at: str = ""
    # workload (Profile.workload) -> local processes -> how much slower its step runs in all at once (contention.py)
    slowdowns: dict[str, dict[int, float]] = field(default_factory=dict)

    def contention(self, key: str, processes: int) -> float | None:
        """How much slower a step (contention.key) runs in `processes` local processes at once than in one;
        None if not measured."""
        return self.slowdowns.get(key, {}).get(processes)

    def link(self, processes: int) -> Link:
        """The local link among `processes` processes: the probe's at that count, or the nearest probed."""
        if processes in self.links:
            return self.links[processes]
        nearest = min(self.links, key=lambda n: (abs(n - processes), -n))
        return self.links[nearest]

    def p2p_link(self, processes: int) -> Link:
        """A send between two of `processes` local processes (a pipeline's hand-over); the collective link if unprobed."""
        if not self.p2p:
            return self.link(processes)
        return self.p2p[min(self.p2p, key=lambda n: (abs(n - processes), -n))]

    def overhead(self, processes: int) -> dict[str, float]:
        """The strategies' measured overheads among `processes` local processes (the nearest probed); {} if none."""
        if not self.overheads:
            return {}
        return self.overheads[min(self.overheads, key=lambda n: (abs(n - processes), -n))]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["overheads"] = {str(n): o for n, o in self.overheads.items()}
        out["links"] = {str(n): link.as_dict() for n, link in self.links.items()}
        out["p2p"] = {str(n): link.as_dict() for n, link in self.p2p.items()}
        out["matmul_flops"] = {str(t): r for t, r in self.matmul_flops.items()}
        out["slowdowns"] = {w: {str(n): f for n, f in by.items()} for w, by in self.slowdowns.items()}
        return {"schema": SCHEMA, **out}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        def links(key: str) -> dict[int, Link]:
            return {int(n): Link(v["bandwidth_bytes_s"], v["latency_s"]) for n, v in data.get(key, {}).items()}

        return cls(
            data["host"],
            data["torch"],
            int(data["cores"]),
            {int(t): float(r) for t, r in data["matmul_flops"].items()},
            links("links"),
            links("p2p"),
            {int(n): dict(o) for n, o in data.get("overheads", {}).items()},
            data.get("probed_at", ""),
            {w: {int(n): float(f) for n, f in by.items()} for w, by in data.get("slowdowns", {}).items()},
        )


# The modules whose code makes the cached figures: a change to any of them is a new cache.
PROBING_MODULES = ("probe.py", "overheads.py", "contention.py", "comm.py")


def probes_digest() -> str:
    """A short digest of the probing modules' source, part of the cache's name."""
    import hashlib

    digest = hashlib.sha256()
    for name in PROBING_MODULES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:10]


def cache_path() -> Path:
    import torch

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchfleet"
    return root / (
        f"plan-{socket.gethostname()}-torch{torch.__version__}-{usable_cores()}cores"
        f"-torchfleet{installed.version()}-{probes_digest()}.json"
    )


def calibration(reprobe: bool = False, say=print, processes: tuple[int, ...] = PROBE_PROCESSES) -> Calibration:
    """This machine's calibration: from the cache, or probed now (and cached) when absent, asked for, or
    missing one of `processes` (the local process counts whose links the plan needs)."""
    path = cache_path()
    cached = None
    if not reprobe and path.is_file():
        try:
            found = json.loads(path.read_text())
            if found.get("schema") == SCHEMA:
                cached = Calibration.from_dict(found)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache is probed again
    missing = tuple(n for n in processes if cached is None or n not in cached.links or n not in cached.overheads)
    if cached is not None and not missing:
        return cached
    say(
        f"probing this machine (matrix multiply rate per thread count; Gloo all-reduce and send, and the"
        f" overheads of fsdp, tp and ddp, among {' and '.join(map(str, missing))} local processes); cached in {path}"
    )
    calib = probe(missing, cached)
    save(calib, say)
    return calib


def save(calib: Calibration, say=print) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(calib.as_dict(), indent=1))
    except OSError as exc:
        say(f"note: the calibration is not cached ({exc.strerror or exc}); the next plan probes again")


def probe(processes: tuple[int, ...] = PROBE_PROCESSES, known: Calibration | None = None) -> Calibration:
    """Measure the links among each of `processes` local processes (and the matmul rates, unless `known`
    has them), added to `known`'s figures."""
    import datetime

    import torch

    cores = usable_cores()
    calib = known or Calibration(socket.gethostname(), torch.__version__, cores)
    calib.probed_at = datetime.datetime.now().isoformat(timespec="seconds")
    for threads in sorted({1, cores}):
        if threads not in calib.matmul_flops:
            calib.matmul_flops[threads] = matmul_rate(threads)
    from torchfleet.launcher.agent import launch

    for n in processes:
        (small, large, p2p_small, p2p_large), costs = launch(all_reduce_times, nprocs=n, args=(max(1, cores // n),))[0]
        calib.links[n] = fit_link(n, small, large)
        calib.overheads[n] = costs
        calib.p2p[n] = Link((LARGE_BYTES - SMALL_BYTES) / max(p2p_large - p2p_small, 1e-9), p2p_small)
    return calib


def matmul_rate(threads: int, size: int = 1024, repeats: int = 4) -> float:
    import torch

    from torchfleet.plan.threads import torch_threads

    with torch_threads(threads):
        a, b = torch.rand(size, size), torch.rand(size, size)
        torch.mm(a, b)  # the first product pays for thread start-up
        best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fit_link(processes: int, small_s: float, large_s: float) -> Link:
    """Latency and bandwidth that make comm.all_reduce_s give the two measured times."""
    hops = 2 * (processes - 1)
    latency = small_s / hops
    spread = max(large_s - small_s, 1e-9)
    bandwidth = 2 * (processes - 1) / processes * (LARGE_BYTES - SMALL_BYTES) / spread
    return Link(bandwidth, latency)


def all_reduce_times(threads: int, repeats: int = 5) -> tuple[tuple[float, float, float, float], dict] | None:
    """In each launched process: the fastest time of a small and of a large Gloo all-reduce, then of a small
    and a large send from rank 0 to rank 1 while the others wait, then the strategies' overheads (rank 0
    returns the four times and the overheads)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    times: dict = {}
    rank = dist.get_rank()

    def send(data):
        if rank == 0:
            dist.send(data, 1)
        elif rank == 1:
            dist.recv(data, 0)

    for op, nbytes in (
        (dist.all_reduce, SMALL_BYTES),
        (dist.all_reduce, LARGE_BYTES),
        (send, SMALL_BYTES),
        (send, LARGE_BYTES),
    ):
        data = torch.ones(nbytes // 4)
        op(data)  # opens the connections (and warms the buffers) before timing
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            op(data)
            seconds.append(time.perf_counter() - start)
        # the slowest rank ends the collective for all
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, min(seconds))  # the fastest: others' load only adds (overheads.py)
        times[(op, nbytes)] = max(found)
    from torchfleet.plan import overheads

    costs = overheads.measure()
    dist.barrier()
    dist.destroy_process_group()
    return (tuple(times.values()), costs) if rank == 0 else None  # pyright: ignore[reportReturnType] (four)
