"""What the per-rank figures cost a step: train's loop with and without them, side by side.

    python benchmarks/rank_view_overhead.py [--nproc 2] [--rounds 15] [--steps 40] [--model cnn] [--device cpu]

Runs itself under `torchfleet run -n NPROC` (gloo on CPU, one thread a
process; `--device cuda`: on the GPU, NCCL for one process, the backend
torchfleet picks for more). Each process sets up the built-in job once (global batch 256),
then takes turns, round after round, between two ways of running blocks of
--steps steps on the same model and process group:

    without  the loader's batches, fleet.train_step, the loss window read
             every --log-every steps (its all-gather carrying the loss alone)
    with     the same, its fetches timed by a PhaseClock (the hooks on every
             parameter and the optimizer), the window carrying each rank's
             figures, and the main rank building the records and judging them

Prints each way's median step time (the block's wall time over its steps,
median over rounds) and the median of the per-round ratios with/without.
Target: at most 1.01.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _worker(args: argparse.Namespace) -> None:
    import torch

    from torchfleet.fleet import Fleet
    from torchfleet.run_services.rank_figures import PhaseClock, gather_rows, hosts, share_host, windows
    from torchfleet.run_services.stragglers import StragglerWatch
    from torchfleet.train.config import TrainConfig
    from torchfleet.train.job import set_up
    from torchfleet.train.losses import LossWindow

    torch.set_num_threads(1)
    cfg = TrainConfig(
        model=args.model,
        data="text" if args.model.startswith("gpt") else "synthetic",
        synthetic_size=8192,
        batch_size=256,
        progress=False,
    )
    fleet = Fleet("ddp", backend="gloo" if args.device == "cpu" else "auto")
    kind = "cuda_max_allocated" if fleet.device.type == "cuda" else "rss"
    job = set_up(cfg, fleet)
    share_host()
    names = hosts(fleet.world_size)
    watch = StragglerWatch()

    def block(with_figures: bool) -> float:
        window = LossWindow(args.log_every, fleet.rank, None, gather_rows)
        clock = PhaseClock(fleet.strategy.model, fleet.strategy.optimizer, fleet.device) if with_figures else None
        batches = iter(clock.batches(job.loader) if clock else job.loader)
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            try:
                inputs, targets = next(batches)
            except StopIteration:
                job.sampler.set_epoch(job.sampler.epoch + 1)
                batches = iter(clock.batches(job.loader) if clock else job.loader)
                inputs, targets = next(batches)
            loss = fleet.train_step(inputs, targets, job.task.loss_fn)
            if clock:
                clock.trained()
            window.add(loss, step)
            if step % args.log_every == 0:
                window.read(False, clock.take() if clock else ())
                if clock and fleet.is_main:
                    watch.judge(windows(step, window.payloads, names, kind))
        seconds = (time.perf_counter() - start) / args.steps
        if clock:
            clock.close()
        return seconds

    block(False)  # warm-up
    times: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(args.rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for way in order:
            times[way].append(block(way == "with"))
    if fleet.is_main:
        plain, timed = statistics.median(times["without"]), statistics.median(times["with"])
        ratio = statistics.median(w / p for w, p in zip(times["with"], times["without"], strict=True))
        print(
            f"{args.model} on {fleet.device.type}, {fleet.world_size} processes, {args.rounds} rounds of {args.steps} steps each way"
        )
        print(f"without per-rank figures: {plain * 1e3:.2f} ms a step (median)")
        print(f"with per-rank figures:    {timed * 1e3:.2f} ms a step (median)")
        print(f"ratio with/without:       {ratio:.4f} (median of the rounds' ratios)")
    fleet.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    own = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--log-every", str(args.log_every)]
    own += ["--model", args.model, "--device", args.device]
    command = [sys.executable, "-m", "torchfleet", "run", "-n", str(args.nproc), __file__, "--worker", *own]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    sys.exit(subprocess.call(command, env=env))


if __name__ == "__main__":
    main()
