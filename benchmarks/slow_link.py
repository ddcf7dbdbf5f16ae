"""DDP over a slow link: no compression, fp16 and PowerSGD, side by side (a benchmark, not a test).

Two network-namespace hosts (tests/netns.py) joined by a link limited with
`tc qdisc ... tbf` to each bandwidth in turn; on them, 2 nodes x 1 process of
DDP train a wide MLP on scikit-learn's digits for the same number of epochs
with each gradient compression. Printed per cell: the median step time, the
samples per second, the speed-up over no compression on the same link, and
the validation accuracy reached. The MLP is wide (default 1024) so that the
gradient exchange, not the arithmetic, dominates a step, as in the models
that need several machines.

    sudo python benchmarks/slow_link.py                      # 1gbit and 100mbit, 6 epochs
    sudo python benchmarks/slow_link.py --bandwidths 100mbit --epochs 3 --hidden 2048

Needs root and iproute2. Each cell runs `torchfleet run --nnodes 2` on both hosts,
with this file as the script (its `--worker` mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPRESSIONS = ("none", "fp16", "powersgd")
ORDER = os.environ.get("SLOW_LINK_ONLY", ",".join(COMPRESSIONS)).split(",")


# ---- worker: runs on every rank under `torchfleet run` ----------------------------------------


def worker(args) -> None:
    import faulthandler
    import signal

    import torch
    from torch import nn

    from torchfleet import Fleet
    from torchfleet.train.datasets import digits
    from torchfleet.train.job import evaluate
    from torchfleet.train.models import mlp

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    options = {"grad_compression": args.compression}
    if args.compression == "powersgd":
        options["powersgd_rank"] = args.powersgd_rank
    fleet = Fleet(strategy="ddp", **options)
    torch.manual_seed(0)
    net = mlp((1, 8, 8), 10, hidden=args.hidden)
    model, optimizer = fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr))
    train_set, val_set = digits("train"), digits("val")
    loader = fleet.dataloader(train_set, args.batch_size, shuffle=True, seed=0)
    loss_fn = nn.CrossEntropyLoss()
    steps = []
    for _ in range(args.epochs):
        for inputs, targets in loader:
            start = time.perf_counter()
            fleet.train_step(inputs, targets, loss_fn)  # DDP's backward waits for the all-reduce
            steps.append(time.perf_counter() - start)
    accuracy = evaluate(fleet, val_set)
    step_s = torch.tensor(statistics.median(steps[3:] or steps), dtype=torch.float64)
    step_s = fleet.all_reduce(step_s, op="max").item()  # the slower node sets the pace
    if fleet.is_main:
        params = sum(p.numel() for p in net.parameters())
        Path(args.out).write_text(
            json.dumps(
                {
                    "compression": args.compression,
                    "step_s": step_s,
                    "steps": len(steps),
                    "samples_per_s": args.batch_size / step_s,
                    "val_accuracy": accuracy,
                    "params": params,
                }
            )
        )
    fleet.close()


# ---- orchestrator: builds the hosts, runs every cell, prints the table -------------------------


def run_cell(net, bandwidth: str, compression: str, port: int, args, workdir: Path) -> dict:
    out = workdir / f"{bandwidth}-{compression}.json"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS=str(args.threads),
    )
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torchfleet",
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            net.addr(0),
            "--master-port",
            str(port),
            "-n",
            "1",
            str(Path(__file__).resolve()),
            "--worker",
            "--compression",
            compression,
            "--hidden",
            str(args.hidden),
            "--epochs",
            str(args.epochs),
            "--batch-size",
            str(args.batch_size),
            "--lr",
            str(args.lr),
            "--powersgd-rank",
            str(args.powersgd_rank),
            "--out",
            str(out),
        ]
        procs.append(net.popen(node, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs) or not out.exists():
        raise SystemExit(f"{bandwidth} {compression} failed:\n" + "\n".join(o[-3000:] for o in outputs))
    result = json.loads(out.read_text())
    # The preflight's all-reduce figure on node 0: what the link gave this cell.
    for line in outputs[0].splitlines():
        if "preflight ok" in line and "Mbit/s" in line:
            result["link_mbit_s"] = float(line.rsplit("(", 1)[1].split()[0])
    return result


def table(results: dict[str, list[dict]], args) -> str:
    rows = [
        f"| link (tbf) | compression | step time (ms) | samples/s | speed-up vs none | "
        f"val accuracy after {args.epochs} epochs |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for bandwidth, cells in results.items():
        base = next(c["step_s"] for c in cells if c["compression"] == "none")
        for c in cells:
            name = c["compression"] + (f" (rank {args.powersgd_rank})" if c["compression"] == "powersgd" else "")
            rows.append(
                f"| {bandwidth} | {name} | {c['step_s'] * 1e3:.1f} | {c['samples_per_s']:.0f} |"
                f" {base / c['step_s']:.2f}x | {100 * c['val_accuracy']:.1f}% |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compression", default="none", choices=COMPRESSIONS)
    p.add_argument("--out", default=None)
    p.add_argument("--bandwidths", default="1gbit,100mbit", help="comma-separated tbf rates")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--powersgd-rank", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process (default 1)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, str(ROOT / "tests"))
    from netns import hosts

    results: dict[str, list[dict]] = {}
    port = 29600
    with tempfile.TemporaryDirectory() as tmp:
        for bandwidth in args.bandwidths.split(","):
            with hosts(2, bandwidth=bandwidth, skip=False) as net:
                for compression in ORDER:
                    port += 1
                    started = time.monotonic()
                    cell = run_cell(net, bandwidth, compression, port, args, Path(tmp))
                    results.setdefault(bandwidth, []).append(cell)
                    print(
                        f"{bandwidth:>8} {compression:>8}: {cell['step_s'] * 1e3:8.1f} ms/step,"
                        f" {100 * cell['val_accuracy']:.1f}% ({time.monotonic() - started:.0f} s,"
                        f" preflight link {cell.get('link_mbit_s', float('nan')):.0f} Mbit/s)",
                        flush=True,
                    )
    params = next(iter(results.values()))[0]["params"]
    print(
        f"\nDDP, 2 nodes x 1 process, MLP 64-{args.hidden}-{args.hidden}-10 ({params / 1e6:.2f} M"
        f" parameters, {params * 4 / 2**20:.1f} MiB of fp32 gradients per step), digits,"
        f" global batch {args.batch_size}, AdamW lr {args.lr}, {args.epochs} epochs\n"
    )
    print(table(results, args))


if __name__ == "__main__":
    main()
