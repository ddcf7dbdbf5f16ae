"""Where an fsdp or pipeline step's time goes: compute, all-gather, reduce-scatter, waiting, bubble.

    python benchmarks/decompose.py                      # gpt tiny and small50m, fsdp and pipeline, 2 processes
    python benchmarks/decompose.py --preset small50m --strategies fsdp --steps 4

The built-in gpt trains under several versions of one strategy in one set of
processes, which take turns (benchmarks/interleave.py), so a busy machine's
drift hits them alike:

- fsdp: FSDP2 written by hand at its defaults (every block a unit, resharded
  after forward); torchfleet's fsdp (the last block kept gathered); no unit
  resharded after forward; explicit prefetch of the next two units in forward
  and backward; units of two blocks. These are the choices torchtitan makes.
- pipeline: torchfleet's 2-stage pipeline under 1f1b with 4 and 8
  micro-batches, and under gpipe with 4.

After the timed turns, each version runs a few steps under torch.profiler
with every `Work.wait` (and the pipeline's wait for its peer) marked, and each
microsecond of the main thread is put in one category by the innermost
labelled range around it (`categorize`). Time the profiler cannot see (Python
between operators) is the step's wall time minus what it saw. The profiler
slows a step down; both step times are printed, and the shares are of the
profiled step.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from interleave import take_turns  # benchmarks/, on the path as the script's folder
from torch.distributed.pipelining import schedules as pipelining_schedules

from torchfleet import Fleet, launch
from torchfleet.models.gpt import gpt, lm_loss

STEP_LABEL = "decompose.step"
PEER_WAIT = "wait for the other stage"
CATEGORIES = (
    "compute",
    "optimizer",
    "all-gather",
    "reduce-scatter",
    "send/recv",
    PEER_WAIT,
    "other collectives",
    "framework",
    "untraced Python",
)


def categorize(names: list[str]) -> str:
    """The category of a main-thread event's own time, from its name and its enclosing ranges' (innermost first)."""

    def anywhere(test: Callable[[str], bool]) -> bool:
        return any(test(n) for n in names)

    if anywhere(lambda n: n == PEER_WAIT):
        return PEER_WAIT
    if anywhere(lambda n: n.startswith(("c10d::send", "c10d::recv"))):
        return "send/recv"
    # FSDP2 labels its hooks: before a unit's forward or backward it gathers (and, in backward, prefetches
    # the next unit's gather); after its backward it reduce-scatters. Everything inside those is the
    # collective's cost: the copy in and out, the wait, and the hook's own Python.
    if anywhere(
        lambda n: n.startswith(
            (
                "FSDP::all_gather",
                "FSDP::pre_forward",
                "FSDP::pre_backward",
                "FSDP::backward_prefetch",
                "FSDP::forward_prefetch",
            )
        )
    ):
        return "all-gather"
    if anywhere(lambda n: n.startswith(("FSDP::post_backward", "FSDP::root_post_backward"))):
        return "reduce-scatter"
    if anywhere(lambda n: n.startswith("Optimizer.step")):
        return "optimizer"
    if anywhere(lambda n: n == "wait" or n.startswith(("c10d::", "gloo:"))):
        return "other collectives"
    if names[0].startswith("aten::"):
        return "compute"
    return "framework"


def _mark_waits() -> None:
    """Put every wait on a collective, and the pipeline's wait for its neighbour, in a named profiler range."""
    work = dist.Work
    plain_wait = work.wait

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function("wait"):
            return plain_wait(self, *args, **kwargs)

    work.wait = wait
    p2p_wait = pipelining_schedules._wait_batch_p2p

    def wait_for_peer(works):
        with torch.profiler.record_function(PEER_WAIT):
            return p2p_wait(works)

    pipelining_schedules._wait_batch_p2p = wait_for_peer


def decompose(step: Callable[[], None], steps: int) -> dict[str, float]:
    """Seconds per step in each category, over `steps` profiled steps on this rank's main thread."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function(STEP_LABEL):
                step()
    events = prof.events()
    windows = [e for e in events if e.name == STEP_LABEL]
    main = windows[0].thread
    spent: dict[str, float] = defaultdict(float)
    for event in events:
        if event.thread != main or event.name == STEP_LABEL:
            continue
        names, up = [event.name], event.cpu_parent
        while up is not None and up.name != STEP_LABEL:
            names.append(up.name)
            up = up.cpu_parent
        if up is None:
            continue  # outside the timed steps
        spent[categorize(names)] += event.self_cpu_time_total / 1e6
    wall = sum(w.cpu_time_total for w in windows) / 1e6
    spent["untraced Python"] = wall - sum(spent.values())
    return {name: seconds / steps for name, seconds in spent.items()} | {"step": wall / steps}


def _tokens(preset_model, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(
        0, preset_model.config.vocab_size, (batch, length + 1), generator=torch.Generator().manual_seed(seed)
    )
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _hand_fsdp(initial, x, y, *, keep_gathered: bool, prefetch: int, blocks_per_unit: int) -> Callable[[], None]:
    """FSDP2 applied by hand, with the knobs torchtitan turns."""
    from torch.distributed.fsdp import fully_shard

    net = copy.deepcopy(initial)
    blocks = list(net.blocks)
    sharded = []
    for i in range(0, len(blocks), blocks_per_unit):
        unit = blocks[i : i + blocks_per_unit]
        sharded.append(fully_shard(unit[0] if len(unit) == 1 else unit, reshard_after_forward=not keep_gathered))
    fully_shard(net)
    # Explicit prefetch, as torchtitan sets it. On CPU nothing runs ahead of the collectives, so FSDP2's
    # own prefetch is one unit, in backward only.
    if prefetch > 1:
        for i, unit in enumerate(sharded):
            unit.set_modules_to_forward_prefetch(sharded[i + 1 : i + 1 + prefetch])
            unit.set_modules_to_backward_prefetch(list(reversed(sharded[max(0, i - prefetch) : i])))
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        lm_loss(net(x), y).backward()
        optimizer.step()

    return step


def _fleet(initial, x, y, strategy: str, **options) -> Callable[[], None]:
    net = copy.deepcopy(initial)
    fleet = Fleet(strategy, **options)
    fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=3e-4), example_inputs=x)
    return lambda: fleet.train_step(x, y, lm_loss)


def _versions(strategy: str, initial, global_batch: int, length: int) -> dict[str, Callable[[], None]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    if strategy == "pipeline":
        x, y = _tokens(initial, global_batch, length, seed=0)  # every stage reads the whole batch
        return {
            "torchfleet 1f1b, 4 micro-batches": _fleet(initial, x, y, "pipeline", microbatches=4),
            "torchfleet 1f1b, 8 micro-batches": _fleet(initial, x, y, "pipeline", microbatches=8),
            "torchfleet gpipe, 4 micro-batches": _fleet(initial, x, y, "pipeline", microbatches=4, schedule="gpipe"),
        }
    x, y = _tokens(initial, global_batch // world, length, seed=rank)
    return {
        "FSDP2 defaults (by hand)": _hand_fsdp(initial, x, y, keep_gathered=False, prefetch=1, blocks_per_unit=1),
        "torchfleet fsdp": _fleet(initial, x, y, "fsdp"),
        "no unit resharded after forward": _hand_fsdp(initial, x, y, keep_gathered=True, prefetch=1, blocks_per_unit=1),
        "prefetch 2 units ahead": _hand_fsdp(initial, x, y, keep_gathered=False, prefetch=2, blocks_per_unit=1),
        "units of 2 blocks": _hand_fsdp(initial, x, y, keep_gathered=False, prefetch=1, blocks_per_unit=2),
    }


def _timed(fn: Callable[[], object], repeats: int = 100) -> float:
    """Median milliseconds of `fn` over `repeats` calls, every rank starting together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        tick = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tick)
    return 1000 * statistics.median(times)


def _collectives(numel: int) -> dict[str, float]:
    """Milliseconds for one block's worth of each collective fsdp and the pipeline use, on this Gloo group.

    A ring reduce-scatter moves half the bytes of a ring all-reduce; if Gloo's takes as long as its
    all-reduce, the difference is Gloo's, not FSDP2's or torchfleet's.
    """
    warnings.filterwarnings("ignore", category=FutureWarning)  # the *_tensor names FSDP2 itself calls
    world, rank = dist.get_world_size(), dist.get_rank()
    full, shard = torch.randn(numel - numel % world), torch.empty(numel // world)
    peer = torch.empty(numel)
    return {
        "all_gather_into_tensor": _timed(lambda: dist.all_gather_into_tensor(full, shard)),
        "reduce_scatter_tensor": _timed(lambda: dist.reduce_scatter_tensor(shard, full)),
        "all_reduce": _timed(lambda: dist.all_reduce(full)),
        "send + recv": _timed(lambda: dist.send(peer, 1) if rank == 0 else dist.recv(peer, 0)),
    }


def _job(
    strategy: str, preset: str, global_batch: int, length: int, steps: int, rounds: int, profiled: int
) -> list[dict] | None:
    torch.set_num_threads(1)  # one core per process: the machine has 2
    dist.init_process_group("gloo")  # the versions share it; torchfleet's Fleets join it
    _mark_waits()
    torch.manual_seed(0)
    initial = gpt(preset)
    versions = _versions(strategy, initial, global_batch, length)
    times = take_turns(versions, blocks=rounds + 1, block_steps=max(1, steps // rounds), warmup_blocks=1)
    rows = []
    for name, step in versions.items():
        dist.barrier()
        parts = decompose(step, profiled)
        slowest = torch.tensor([parts[c] if c in parts else 0.0 for c in (*CATEGORIES, "step")])
        gathered = [torch.zeros_like(slowest) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, slowest)
        rows.append(
            {
                "version": name,
                "median_ms": 1000 * statistics.median(times[name]),
                "per_rank": [dict(zip((*CATEGORIES, "step"), t.tolist(), strict=True)) for t in gathered],
            }
        )
    # fsdp's message: one block's parameters; the pipeline's: one micro-batch's activations at the cut.
    block = sum(p.numel() for p in initial.blocks[0].parameters())
    cut = global_batch // 4 * length * initial.config.n_embd
    rows.append(
        {
            "collectives": _collectives(block if strategy == "fsdp" else cut),
            "numel": block if strategy == "fsdp" else cut,
        }
    )
    return rows if dist.get_rank() == 0 else None


def _print(strategy: str, preset: str, rows: list[dict]) -> None:
    probe = rows.pop()
    shown = [c for c in CATEGORIES if any(r[c] > 0.0005 for row in rows for r in row["per_rank"])]
    print(f"\n### {strategy}, gpt {preset}\n")
    print("| version | rank | step ms (not profiled, median) | profiled ms | " + " | ".join(shown) + " |")
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in shown) + " |")
    for row in rows:
        for rank, parts in enumerate(row["per_rank"]):
            cells = " | ".join(f"{1000 * parts[c]:.1f} ({parts[c] / parts['step']:.0%})" for c in shown)
            print(f"| {row['version']} | {rank} | {row['median_ms']:.1f} | {1000 * parts['step']:.1f} | {cells} |")
    what = "one block's parameters" if strategy == "fsdp" else "one micro-batch's activations at the cut (of 4)"
    print(
        f"\nOne collective on {probe['numel']:,} fp32 values ({what}), median ms: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in probe["collectives"].items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny,small50m", help="gpt presets (default tiny,small50m)")
    parser.add_argument("--strategies", default="fsdp,pipeline", help="fsdp, pipeline or both (default)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per version (default 12)")
    parser.add_argument("--rounds", type=int, default=3, help="turns each version takes (default 3)")
    parser.add_argument("--profiled", type=int, default=3, help="profiled steps per version (default 3)")
    args = parser.parse_args()
    print(
        f"# {time.strftime('%d %b %Y %H:%M UTC', time.gmtime())}, torch {torch.__version__}, Gloo, 2 processes,"
        f" one thread each, global batch {args.global_batch} x {args.length} tokens"
    )
    for preset in args.preset.split(","):
        for strategy in args.strategies.split(","):
            rows = launch(
                _job,
                nprocs=2,
                args=(strategy, preset, args.global_batch, args.length, args.steps, args.rounds, args.profiled),
            )[0]
            _print(strategy, preset, rows)


if __name__ == "__main__":
    main()
