"""fsdp against fsdp+ep on the built-in mixture-of-experts gpt: step time, memory per rank, the all-to-all's share.

Four processes (--nproc) train gpt-moe (the tiny preset's sizes, 8 experts, top 2) with AdamW under
each strategy in turn, rounds alternating the two so both see the same machine load. Per run, on the
main rank:
- the step time: the median of the timed steps, after --warmup untimed ones;
- what each rank holds (parameters, gradients, optimizer state, and of those the experts' bytes),
  measured from its own tensors (the strategy's memory report);
- the all-to-all's share of the step: the time Gloo's all-to-all work ran (dispatch and combine,
  forward and backward, and the counts before them; waiting for the slowest rank included) over the
  wall time of a few more steps under torch's profiler, which are not among the timed ones.
Printed: each round's figures, then the medians over rounds, and the ratio fsdp+ep / fsdp of the medians
and the median of each round's ratio (its two runs side by side).

    .venv/bin/python benchmarks/moe_ep.py                      # 4 processes, 3 rounds
    .venv/bin/python benchmarks/moe_ep.py --rounds 5 --batch 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torchfleet import launch

STRATEGIES = ("fsdp", "fsdp+ep")


def _loss(out, targets):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1))


def measure(strategy: str, batch: int, seq: int, warmup: int, steps: int, profiled: int) -> dict | None:
    """One run in the launched processes; the figures on the main rank, None elsewhere."""
    from torch.profiler import ProfilerActivity, profile

    from torchfleet import Fleet
    from torchfleet.train.models import build_model

    fleet = Fleet(strategy=strategy)
    torch.manual_seed(0)
    net = build_model("gpt-moe", (seq,), num_classes=10, gpt_preset="tiny")
    fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(fleet.rank)
    tokens = torch.randint(0, 64, (batch, seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    for _ in range(warmup):
        fleet.train_step(inputs, targets, _loss)
    times = []
    for _ in range(steps):
        fleet.barrier()
        start = time.perf_counter()
        fleet.train_step(inputs, targets, _loss).item()
        times.append(time.perf_counter() - start)
    fleet.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(profiled):
            fleet.train_step(inputs, targets, _loss).item()
        wall = time.perf_counter() - start
    exchanged = sum(e.cpu_time_total for e in prof.key_averages() if e.key == "gloo:all_to_all") / 1e6
    memory = fleet.strategy.memory_report()
    main = fleet.is_main
    fleet.close()
    if not main:
        return None
    return {"step_s": statistics.median(times), "all_to_all_share": exchanged / wall, "memory": memory}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profiled", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    for round_ in range(args.rounds):
        for strategy in STRATEGIES:
            got = launch(
                measure,
                nprocs=args.nproc,
                args=(strategy, args.batch, args.seq, args.warmup, args.steps, args.profiled),
            )[0]
            rows[strategy].append(got)
            held = got["memory"]["rank 0"]
            print(
                f"round {round_ + 1} {strategy:8s} step {got['step_s'] * 1e3:7.1f} ms, all-to-all"
                f" {got['all_to_all_share']:5.1%} of it; rank 0 holds params {_mib(held['params'])} MiB"
                f" (experts {_mib(held.get('of which experts', 0))}), grads {_mib(held['grads'])},"
                f" optimizer {_mib(held['optimizer'])}",
                flush=True,
            )
    print(
        f"\nmedians over {args.rounds} rounds, {args.nproc} processes, gpt-moe, {args.batch}x{args.seq} tokens per rank"
    )
    medians = {}
    for strategy in STRATEGIES:
        step = statistics.median(r["step_s"] for r in rows[strategy])
        share = statistics.median(r["all_to_all_share"] for r in rows[strategy])
        medians[strategy] = step
        held = rows[strategy][0]["memory"]["rank 0"]
        total = held["params"] + held["grads"] + held["optimizer"]
        print(
            f"{strategy:8s} step {step * 1e3:7.1f} ms  all-to-all {share:5.1%}  rank 0 state {_mib(total)} MiB"
            f" (experts' parameters {_mib(held.get('of which experts', 0))} MiB)"
        )
    ratios = [ep["step_s"] / fsdp["step_s"] for fsdp, ep in zip(rows["fsdp"], rows["fsdp+ep"], strict=True)]
    print(
        f"fsdp+ep / fsdp step time: {medians['fsdp+ep'] / medians['fsdp']:.2f} (medians);"
        f" {statistics.median(ratios):.2f} (median of the rounds' ratios: {', '.join(f'{r:.2f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
