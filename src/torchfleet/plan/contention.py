"""How much slower a model's step runs when N processes on this machine run it at once: measured, per model.

The profile (profiler.py) times the model's step in one process. A job's N
processes run that step at the same time, and on a CPU they share more than
the cores each is given: the memory bandwidth, the last-level cache, a
physical core's two hyper-threads where the "cores" are those; and where N
processes outnumber the cores, the cores themselves. How much each model
loses to that depends on the model and on the neighbours' load (here, 2
processes on 2 cores in a quiet minute: gpt tiny, cnn and gpt small50m 1.06
to 1.07, resnet18 1.16; at a load average of 5 to 8, 1.3 to 2.0), so it is
measured with the model itself, when the plan is made:

    N processes (launched as a job's are, each with cores // N threads) build the
    model at the local batch global / N; in rounds (3 to 12: as many as fit in
    about 8 s), process 0 runs a step alone
    while the others wait at a barrier, then all N run a step at once;
    slowdown(N) = the fastest all-at-once step (the slowest process's) / the fastest alone.

The fastest of the rounds, as everywhere in the calibration: others' load on
a shared machine only adds. The figure is cached with the calibration per
host, per model (and its preset, image size and local batch) and per N;
--reprobe measures it again.
"""

from __future__ import annotations

import time

ROUNDS = (3, 12)  # the fewest and the most rounds: as many as fit in BUDGET_S, more rounds see a quieter moment
BUDGET_S = 8.0
MIN_ROUND_S = 0.05  # a round of a fast model's steps lasts at least this long, so the timer's noise stays small


def key(workload: str, global_batch: int, processes: int) -> str:
    """The cache's name for a model's step at the local batch `processes` readers of `global_batch` get."""
    return f"{workload}/b{max(1, global_batch // processes)}"


def measure_missing(calib, profile, spec: dict, global_batch: int, counts, say=print) -> None:
    """slowdown(N) for each of `counts` (N of 2 or more) that `calib` lacks for this model and batch; cached."""
    from torchfleet.plan.probe import save

    missing = [n for n in counts if n > 1 and calib.contention(key(profile.workload, global_batch, n), n) is None]
    if not missing:
        return
    say(
        f"probing how much slower {profile.workload}'s step runs in {' and '.join(map(str, missing))} processes"
        " at once than in one (cached)"
    )
    for n in missing:
        local = max(1, global_batch // n)
        found = slowdown(spec, n, local, max(1, calib.cores // n), profile.optimizer)
        calib.slowdowns.setdefault(key(profile.workload, global_batch, n), {})[n] = found
    save(calib, say)


def slowdown(spec: dict, processes: int, batch: int, threads: int, optimizer: str) -> float:
    """slowdown(N) of the module's docstring, measured now in `processes` launched processes."""
    from torchfleet.launcher.agent import launch

    return launch(_rounds, nprocs=processes, args=(spec, batch, threads, optimizer))[0]


def _rounds(spec: dict, batch: int, threads: int, optimizer: str) -> float | None:
    """In each launched process: the rounds of the docstring; rank 0 returns the ratio."""
    import torch
    import torch.distributed as dist

    from torchfleet.plan.workload import make_optimizer, train_step, workload

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, inputs, targets, loss_fn = workload(spec, batch)
    opt = make_optimizer(optimizer, model.parameters())

    def step() -> None:
        train_step(model, opt, inputs, targets, loss_fn)

    step()  # the optimizer's state, and this thread count's threads, exist from here on
    seconds = _seconds(step, 1)
    # a fast model's round repeats its step, so a round is long enough to time; every process agrees on the
    # counts (the slowest's figure), as every round meets at a barrier
    repeats = max(1, int(MIN_ROUND_S / max(seconds, 1e-6)))
    rounds = min(ROUNDS[1], max(ROUNDS[0], int(BUDGET_S / (2 * repeats * seconds))))
    counts = torch.tensor([repeats, -rounds])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    repeats, rounds = int(counts[0]), -int(counts[1])
    alone, together = [], []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            alone.append(_seconds(step, repeats))
        dist.barrier()
        together.append(_seconds(step, repeats))
    slowest = torch.tensor(together, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return max(1.0, min(slowest.tolist()) / min(alone)) if rank == 0 else None


def _seconds(step, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return time.perf_counter() - start
