"""What per-step fault tolerance costs when nothing fails: ddp against --fault-tolerance step (a benchmark).

Three network-namespace hosts (tests/netns.py; --hosts), one process each, train
the same job twice per round: plain ddp across the three machines (torchrun's
static rendezvous, DDP's all-reduce overlapping the backward), and the same
command with `--fault-tolerance step` (each machine a replica group; torchft's
quorum each step, its all-reduce of the gradients after the backward, its
commit before the optimizer step). Rounds alternate the two, so both see the
same machine load. Each run writes a row per step (--metrics-out, --log-every 1);
a run's step time is the median of its steps after the first `--skip`
(start-up, first quorum). Printed: each run's median, the median over rounds,
and the ratio ft / ddp.

    sudo .venv/bin/python benchmarks/ft_overhead.py                   # cnn, 3 rounds
    sudo .venv/bin/python benchmarks/ft_overhead.py --model gpt --batch-size 32 --rounds 5

Needs root, iproute2 and torchft.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from netns import hosts  # noqa: E402


def run_once(net, ft: bool, args, folder: Path, port: int) -> float:
    """One job on the hosts; the median seconds per step of host 0's main rank."""
    procs = []
    for i in range(args.hosts):
        data = (
            ["--data", "synthetic", "--synthetic-size", str(args.batch_size * (args.steps + 1))]
            if args.model != "gpt"
            else []
        )  # one epoch holds every step: no evaluation between them
        argv = [
            sys.executable,
            "-m",
            "torchfleet",
            "train",
            "--strategy",
            "ddp",
            "--model",
            args.model,
            *data,
            "--batch-size",
            str(args.batch_size),
            "--epochs",
            "1",
            "--max-steps",
            str(args.steps),
            "--log-every",
            "1",
            "--no-progress",
            "--hang-timeout",
            "0",
            "--nnodes",
            str(args.hosts),
            "--node-rank",
            str(i),
            "--master-addr",
            net.addr(0),
            "--master-port",
            str(port),
            "-n",
            "1",
            "--metrics-out",
            str(folder / f"host{i}.csv"),
        ]
        if ft:
            argv += ["--fault-tolerance", "step"]
        procs.append(
            net.popen(
                i,
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**__import__("os").environ, "OMP_NUM_THREADS": str(args.threads)},
            )
        )
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"a run failed ({'ft' if ft else 'ddp'}):\n{out}")
    rows = [r for r in csv.DictReader((folder / "host0.csv").open()) if r["kind"] == "train"]
    elapsed = [float(r["elapsed_s"]) for r in rows]
    steps = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)][args.skip :]
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch-size", type=int, default=192)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="steps left out at the start of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process (3 on a 2-core machine)")
    parser.add_argument("--bandwidth", default=None, help="tbf on every host's link, e.g. 1gbit")
    parser.add_argument("--hosts", type=int, default=3, help="namespace hosts, one process each (default 3)")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"ddp": [], "ft": []}
    with hosts(args.hosts, bandwidth=args.bandwidth, skip=False) as net, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in ("ddp", "ft"):
                folder = Path(tmp) / f"{name}{r}"
                folder.mkdir()
                seconds = run_once(net, name == "ft", args, folder, 29500 + 2 * r + (name == "ft"))
                results[name].append(seconds)
                print(f"round {r + 1}: {name:3s} {seconds * 1e3:8.1f} ms/step", flush=True)
    ddp, ft = statistics.median(results["ddp"]), statistics.median(results["ft"])
    print(
        f"\n{args.model}, global batch {args.batch_size}, {args.hosts} hosts x 1 process"
        f"{', ' + args.bandwidth if args.bandwidth else ''}, {args.rounds} rounds:"
    )
    print(f"  ddp                      {ddp * 1e3:8.1f} ms/step (median of rounds)")
    print(f"  --fault-tolerance step   {ft * 1e3:8.1f} ms/step")
    print(f"  ratio ft / ddp           {ft / ddp:8.3f}")


if __name__ == "__main__":
    main()
