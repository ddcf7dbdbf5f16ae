"""`torchfleet plan` for two CPU machines on a slow link, against the real job on two namespace hosts.

For each bandwidth (tbf on each host's egress, tests/netns.py) and each strategy (ddp, fsdp), this
runs bench's workload on two network-namespace hosts, one process each (`torchfleet run --nnodes 2`
with this file as the script, its --worker mode), timed as `torchfleet plan --check` times a cell
(plan/check.run_check_cell: warm-up, then steps from a barrier, each the slower rank's), and asks
the planner for the same job on a described cluster:

    torchfleet plan --model M --batch-size B --nodes 2 --cpus-per-node 1 --link GBIT --strategies ddp,fsdp

whose compute comes from the model's step measured here on one thread and whose strategy overheads
come from this machine's probes; the link is the flag. Printed: predicted against measured, per cell.

    sudo .venv/bin/python benchmarks/plan_links.py                         # gpt tiny, 100mbit and 1gbit
    sudo .venv/bin/python benchmarks/plan_links.py --model resnet18 --image-size 64 --batch-size 16

Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GBIT = {"100mbit": 0.1, "1gbit": 1.0}


def worker(args) -> None:
    from torchfleet.plan.check import run_check_cell
    from torchfleet.plan.config import PlanConfig
    from torchfleet.plan.run import spec_of

    cfg = PlanConfig(model=args.model, gpt_preset=args.gpt_preset, image_size=args.image_size, batch=args.batch_size)
    spec = {
        **spec_of(cfg),
        "precision": "fp32",
        "warmup": args.warmup,
        "steps": args.steps,
        "options": {},
        "strategy": args.strategy,
        "processes": 2,
        "global_batch": args.batch_size,
        "threads": 1,
    }
    result = run_check_cell(spec)
    if result is not None:
        Path(args.out).write_text(json.dumps(result))


def measure(net, strategy: str, port: int, args, out: Path) -> float:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="eth0",
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
            "--strategy",
            strategy,
            "--model",
            args.model,
            "--gpt-preset",
            args.gpt_preset,
            "--image-size",
            str(args.image_size),
            "--batch-size",
            str(args.batch_size),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
            "--out",
            str(out),
        ]
        procs.append(net.popen(node, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs) or not out.exists():
        raise SystemExit(f"{strategy} failed:\n" + "\n".join(o[-3000:] for o in outputs))
    return json.loads(out.read_text())["step_time_median_s"]


def predict(args, gbit: float, workdir: Path) -> dict[str, float]:
    out = workdir / f"plan-{gbit}.json"
    cmd = [
        sys.executable,
        "-m",
        "torchfleet",
        "plan",
        "--model",
        args.model,
        "--gpt-preset",
        args.gpt_preset,
        "--image-size",
        str(args.image_size),
        "--batch-size",
        str(args.batch_size),
        "--optimizer",
        "sgd",
        "--nodes",
        "2",
        "--cpus-per-node",
        "1",
        "--link",
        str(gbit),
        "--strategies",
        "ddp,fsdp",
        "--nproc",
        "2",
        "--json-out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    if done.returncode:
        raise SystemExit(f"plan failed: {done.stderr[-2000:]}")
    return {p["strategy"]: p["time"]["step"] for p in json.loads(out.read_text())["predictions"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--out", default=None)
    p.add_argument("--model", default="gpt")
    p.add_argument("--gpt-preset", default="tiny")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--bandwidths", default="100mbit,1gbit", help="comma-separated tbf rates")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, str(ROOT / "tests"))
    from netns import hosts

    rows = []
    port = 29700
    with tempfile.TemporaryDirectory() as tmp:
        for bandwidth in args.bandwidths.split(","):
            predicted = predict(args, GBIT[bandwidth], Path(tmp))
            with hosts(2, bandwidth=bandwidth, skip=False) as net:
                for strategy in ("ddp", "fsdp"):
                    port += 1
                    started = time.monotonic()
                    measured = measure(net, strategy, port, args, Path(tmp) / f"{bandwidth}-{strategy}.json")
                    rows.append((bandwidth, strategy, predicted[strategy], measured))
                    print(
                        f"{bandwidth:>8} {strategy:>5}: predicted {predicted[strategy] * 1e3:8.1f} ms, measured"
                        f" {measured * 1e3:8.1f} ms ({time.monotonic() - started:.0f} s)",
                        flush=True,
                    )
    name = args.model + (f" {args.gpt_preset}" if args.model == "gpt" else f" {args.image_size} px")
    print(f"\n{name}, global batch {args.batch_size}, SGD with momentum, 2 hosts x 1 process (1 thread)\n")
    print("| link (tbf) | strategy | predicted step (ms) | measured step (ms) | predicted / measured |")
    print("| --- | --- | ---: | ---: | ---: |")
    for bandwidth, strategy, pred, meas in rows:
        print(f"| {bandwidth} | {strategy} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | {pred / meas:.2f} |")


if __name__ == "__main__":
    main()
