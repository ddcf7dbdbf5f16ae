"""The pipeline's bubble under each schedule: measured idle fraction next to its formula, and step time.

    python benchmarks/bubble.py                 # 2 and 4 processes, every schedule the installed torch runs
    python benchmarks/bubble.py --nproc 2 --steps 20
    python benchmarks/bubble.py --width 2048      # stages whose compute dwarfs a send

A Sequential of 8 equal Linear+ReLU blocks (one block per stage at 8 stages)
trains on a fixed batch under each schedule: gpipe and 1f1b with one stage
per process, the multi-stage schedules with 2 per process (on 2 processes the
model is cut into 4 stages, on 4 into 8). Each process's busy time is the time
inside its stages' forward and backward (Pipeline.pipeline_report, timed by
strategies/pipeline/stages.TimedStage); its bubble is 1 - busy / step time, averaged
over the processes. The formula is strategies/pipeline/schedules.bubble_formula:
(p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v*m+p-1) for v stages per process,
a third of it or none for zero bubble. All schedules of one process count run in one set of
processes, interleaved step by step over several rounds, so drift on a
shared machine hits them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from torchfleet import Fleet, launch
from torchfleet.strategies.pipeline.schedules import MULTI_STAGE, available

BLOCKS, BATCH, MICROBATCHES = 8, 256, 8


def _model(width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _setups() -> list[tuple[str, int]]:
    here = available()
    return [(s, 1) for s in ("gpipe", "1f1b") if s in here] + [(s, 2) for s in MULTI_STAGE if s in here]


def _job(steps: int, warmup: int, rounds: int, width: int) -> list[dict] | None:
    torch.set_num_threads(1)  # one core's worth per process: the machine has 2 cores for up to 4 processes
    fleets = []
    for schedule, per in _setups():
        fleet = Fleet(strategy="pipeline", schedule=schedule, stages_per_process=per, microbatches=MICROBATCHES)
        torch.manual_seed(0)
        model = _model(width)
        fleet.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
        fleets.append((schedule, per, fleet))
    gen = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)
    loss_fn = nn.MSELoss()
    times: dict[str, list[float]] = {schedule: [] for schedule, _, _ in fleets}
    for _, _, fleet in fleets:
        for _ in range(warmup):
            fleet.train_step(inputs, targets, loss_fn)
    for _ in range(rounds):  # interleaved: each round gives every schedule steps // rounds steps
        for schedule, _, fleet in fleets:
            for _ in range(steps // rounds):
                dist.barrier()
                tick = time.perf_counter()
                fleet.train_step(inputs, targets, loss_fn)
                took = torch.tensor(time.perf_counter() - tick)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest process
                times[schedule].append(took.item())
    rows = []
    for schedule, per, fleet in fleets:
        report = fleet.strategy.pipeline_report()  # the busy time of the timed steps (warm-up too, but the first)
        measured = [b for b in report["bubble_measured"] if b == b]
        rows.append(
            {
                "processes": dist.get_world_size(),
                "schedule": schedule,
                "stages": report["stages"],
                "per_process": per,
                "microbatches": report["microbatches"],
                "step_ms": 1000 * statistics.median(times[schedule]),
                "bubble": statistics.mean(measured),
                "formula": report["bubble_formula"],
            }
        )
    return rows if dist.get_rank() == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4", help="process counts (default 2,4)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per schedule (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="interleaving rounds (default 4)")
    parser.add_argument(
        "--width",
        type=int,
        default=512,
        help="each block's Linear(width, width) (default 512); wider blocks make a stage's compute dwarf its sends",
    )
    args = parser.parse_args()
    print(
        f"# {time.strftime('%d %b %Y %H:%M UTC', time.gmtime())}, torch {torch.__version__}, Gloo,"
        f" Sequential of {BLOCKS} Linear({args.width}, {args.width}) + ReLU, batch {BATCH}, {MICROBATCHES} micro-batches"
    )
    print("| processes | schedule | stages (per process) | step ms (median) | bubble measured | formula |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for nproc in (int(n) for n in args.nproc.split(",")):
        rows = launch(_job, nprocs=nproc, args=(args.steps, args.warmup, args.rounds, args.width))[0]
        for r in rows:
            print(
                f"| {r['processes']} | {r['schedule']} | {r['stages']} ({r['per_process']}) | {r['step_ms']:.1f}"
                f" | {r['bubble']:.3f} | {r['formula']:.3f} |"
            )
        base = next(r for r in rows if r["schedule"] == "1f1b")
        best = min(rows, key=lambda r: r["step_ms"])
        print(f"| {nproc} | best: {best['schedule']} | | {base['step_ms'] / best['step_ms']:.2f}x 1f1b's speed | | |")


if __name__ == "__main__":
    main()
