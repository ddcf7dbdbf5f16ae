"""bench's verdicts and the straggler verdicts beside a CPU load: do they hold on a machine that is not idle?

    python benchmarks/busy_verdicts.py bench --load none --runs 5      # torchfleet bench --quick, 5 times
    python benchmarks/busy_verdicts.py bench --load busy --runs 5      # the same beside 2 busy processes
    python benchmarks/busy_verdicts.py train --load none --runs 5      # train --strategy ddp -n 2 --model gpt --epochs 30
    python benchmarks/busy_verdicts.py train --load busy --runs 5      # the same beside 2 busy processes
    python benchmarks/busy_verdicts.py train --load pinned --runs 5    # each rank pinned to its own core, the busy
                                                                       # processes pinned to rank 1's (Linux, taskset)

A busy process is `python -c "while True: pass"`. With --nice N (root may give a negative N) the runs and the
busy processes start at that priority, ahead of other people's jobs on a shared machine. One JSON line a run:
for bench, the first line it printed, the verdict, each cell's speedup, flags and other processes' cores; for
train, the ranks named (rank, phase, step), the steps of the busy machine's notes, and per run rank 1's compute
over rank 0's (median, range), other processes' cores and each rank's wait for a CPU, from its metrics file.
The workers of a pinned run are found as the children of the run's forkserver, in fork order (rank 0 first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BUSY = "while True: pass"


def _busy(n: int, nice: list[str], cpu: int | None = None) -> list[subprocess.Popen]:
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    return [subprocess.Popen([*pin, *nice, sys.executable, "-c", BUSY]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def _bench(out: Path, nice: list[str]) -> dict:
    done = subprocess.run([*nice, "torchfleet", "bench", "--quick", "--out", str(out)], capture_output=True, text=True)
    doc = json.loads((out / "results.json").read_text())
    cells = {c["strategy"] + ("" if c["processes"] == 1 else f" x{c['processes']}"): c for c in doc["cells"]}
    return {
        "first": done.stdout.strip().splitlines()[0],
        "verdict": doc["verdict"],
        "speedups": {k: round(c["speedup"], 2) for k, c in cells.items() if c["speedup"] is not None},
        "flags": {k: c["flags"] for k, c in cells.items() if c["flags"]},
        "others_cores": {k: round(c["others_cores"], 2) for k, c in cells.items() if c["others_cores"] is not None},
    }


def _workers(marker: str) -> list[int]:
    """The run's workers: children of its forkserver, which carry `marker` in their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in env and b"forkserver" in parent:
            found.append(int(entry.name))
    return sorted(found)


def _train(metrics: Path, load: str, busy: int, nice: list[str], run: int) -> dict:
    marker = f"BUSY_VERDICTS_RUN={os.getpid()}-{run}"
    command = ["torchfleet", "train", "--strategy", "ddp", "-n", "2", "--model", "gpt", "--epochs", "30"]
    command += ["--no-progress", "--metrics-out", str(metrics)]
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    others = _busy(busy, nice) if load == "busy" else []
    job = subprocess.Popen([*nice, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if load == "pinned":
        workers: list[int] = []
        while len(workers) < 2 and job.poll() is None:
            time.sleep(0.2)
            workers = _workers(marker)
        for cpu, pid in enumerate(workers[:2]):
            subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], capture_output=True, check=False)
        others = _busy(busy, nice, cpu=1)
    job.communicate()
    _stop(others)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    ranks = [r for r in rows if r["kind"] == "rank" and r["step"] > 10]
    ratios = []
    for step in sorted({r["step"] for r in ranks}):
        pair = {r["rank"]: r for r in ranks if r["step"] == step}
        if pair.get(0, {}).get("compute_s"):
            ratios.append(pair[1]["compute_s"] / pair[0]["compute_s"])
    return {
        "named": [(r["rank"], r["phase"], r["step"]) for r in rows if r["kind"] == "straggler"],
        "busy_notes": [r["step"] for r in rows if r["kind"] == "machine"],
        "rank1_over_rank0_compute": [round(statistics.median(ratios), 2), round(min(ratios), 2), round(max(ratios), 2)],
        "others_cores": round(statistics.median(r["others_cores"] for r in ranks if r["others_cores"] is not None), 2),
        "wait_share": [
            round(statistics.median(r["cpu_wait_s"] / r["step_s"] for r in ranks if r["rank"] == k), 2) for k in (0, 1)
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("bench", "train"))
    parser.add_argument("--load", choices=("none", "busy", "pinned"), default="none")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the run (default 2)")
    parser.add_argument("--nice", type=int, default=None, help="the runs' and busy processes' niceness")
    parser.add_argument("--out", default="runs/busy-verdicts")
    args = parser.parse_args()
    if args.load == "pinned" and (args.what != "train" or shutil.which("taskset") is None):
        parser.error("--load pinned is for train, and needs taskset (util-linux)")
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be at least 1 and --busy at least 0")
    nice = ["nice", "-n", str(args.nice)] if args.nice is not None else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for run in range(args.runs):
        start = time.monotonic()
        if args.what == "bench":
            procs = _busy(args.busy, nice) if args.load == "busy" else []
            try:
                row = _bench(out / f"bench-{args.load}-{run}", nice)
            finally:
                _stop(procs)
        else:
            row = _train(out / f"train-{args.load}-{run}.jsonl", args.load, args.busy, nice, run)
        load = os.getloadavg()[0]
        print(
            json.dumps(
                {"run": run, "load": args.load, "seconds": round(time.monotonic() - start), "load_average": load, **row}
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
