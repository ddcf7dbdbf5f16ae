"""torchfleet against hand-written PyTorch, Accelerate and Lightning Fabric, side by side.

    make parity                   # installs accelerate and lightning, then runs this
    python benchmarks/parity.py [--rounds 3] [--out runs/parity]

Three measurements, each interleaved (A B C D A B C D ...) so that drift on a
shared machine hits every contender alike; every figure is a median.

1. Parity: the same job (CNN, synthetic in-memory data, global batch 256,
   seed 0, SGD, 2 processes on CPU with gloo, one intra-op thread each) four
   ways (benchmarks/parity_worker.py), in one torchrun launch per round, the
   ways taking turns in blocks of 10 steps inside it. Reports each way's median step time (fetching the batch included) and its
   ratio to the hand-written loop (the median of the per-round ratios), and
   checks that torchfleet's final weights equal the hand-written loop's bit
   for bit. Target: torchfleet within 1% of hand-written, and no slower than
   Accelerate or Fabric.
2. Scaling: DDP on the CNN at 256 samples per process on 2 processes
   (`--nprocs 2,4,8` for more counts) against one process at 256, one thread
   per process; efficiency = samples/s(n processes) / (n x samples/s(1
   process)), for the hand-written loop, the hand-written loop with glibc's
   malloc thresholds raised through the environment (what
   torchfleet.allocator does from inside), and torchfleet; and, to show what
   the machine allows, processes that never communicate (free) and processes
   that meet once per step in a 4-byte all-reduce (lockstep: the floor of any
   synchronous data-parallel step). `--scaling-ways` picks some of these.
   Each way runs in launches of its own, so one way's process settings cannot
   help another. Target: torchfleet >= 0.90 at 2 processes, >= 0.80 at 8.
3. gpt (`--only gpt`): the built-in gpt (`--preset`, default small50m) under ddp, fsdp
   and a 2-stage pipeline on 2 processes, hand-written against torch (DDP; FSDP2's
   fully_shard per block, then the root; a pipeline cut by hand at the middle block
   under torch.distributed.pipelining's 1F1B), through torchfleet and, under ddp and
   fsdp, through Accelerate and Fabric (their FSDP2 routes: benchmarks/parity_gpt_peers.py;
   neither has a pipeline strategy), interleaved in blocks of steps in one launch per
   round (benchmarks/parity_gpt_worker.py). Reports each way's median step time, the
   median of the per-round ratios torchfleet / each other way, and the largest
   difference between each way's final weights and the hand-written way's. A peer that
   is not installed or fails is left out with one line saying why. Target: torchfleet
   within 1.02x of hand-written, weights within 1e-6.
4. Start-up: wall time from the command to the end of the first training step
   of benchmarks/first_step.py under `torchfleet run -n 2` and under
   `torchrun --standalone --nproc-per-node 2`. Target: within 10%.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "parity_worker.py"
FIRST_STEP = HERE / "first_step.py"
GPT_WORKER = HERE / "parity_gpt_worker.py"
GPT_STRATEGIES = ("ddp", "fsdp", "pipeline")
GPT_WAYS = ("hand", "torchfleet", "accelerate", "fabric")
GPT_PEERS = ("accelerate", "fabric")
WAYS = ("hand", "torchfleet", "accelerate", "fabric")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _env() -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    # One intra-op thread per process, said out loud (torchrun would set it and warn).
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


# glibc reads these at start-up: the hand-written loop gets, from outside, what
# torchfleet.allocator sets from inside with mallopt.
GLIBC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def _try_run(cmd: list[str], timeout: float = 600, extra_env: dict | None = None) -> str:
    """Runs cmd; "" if it succeeded, else what it said at the end."""
    try:
        done = subprocess.run(cmd, env={**_env(), **(extra_env or {})}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s: {' '.join(cmd)}"
    if done.returncode == 0:
        return ""
    return f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _run(cmd: list[str], timeout: float = 600, extra_env: dict | None = None) -> None:
    error = _try_run(cmd, timeout, extra_env)
    if error:
        sys.exit(error)


def _job(
    nproc: int, out: Path, ways: tuple[str, ...], extra_env: dict | None = None, **flags
) -> dict[str, list[float]]:
    """One launch of parity_worker.py: each way's step times (the ways interleaved in blocks)."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    _run(
        [*TORCHRUN, f"--nproc-per-node={nproc}", str(WORKER), f"--out={out}", f"--ways={','.join(ways)}", *args],
        extra_env=extra_env,
    )
    return json.loads((out / "steps.json").read_text())["step_times"]


def _same_weights(out: Path) -> bool:
    import torch

    a = torch.load(out / "hand.pt", weights_only=True)
    b = torch.load(out / "torchfleet.pt", weights_only=True)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def parity(rounds: int, out: Path) -> dict:
    medians = {w: [] for w in WAYS}
    equal = []
    for r in range(rounds):
        times = _job(2, out, WAYS)
        for way in WAYS:
            medians[way].append(statistics.median(times[way]))
        equal.append(_same_weights(out))
        print(
            f"  parity round {r + 1}/{rounds}: "
            + ", ".join(f"{w} {medians[w][-1] * 1e3:.2f}" for w in WAYS)
            + " ms/step",
            flush=True,
        )
    # The ratio of each round's medians, then the median over rounds.
    ratios = {w: statistics.median(m / h for m, h in zip(medians[w], medians["hand"], strict=True)) for w in WAYS}
    return {
        "median_step_s": {w: statistics.median(m) for w, m in medians.items()},
        "per_round_step_s": medians,
        "ratio_to_hand": ratios,
        "torchfleet_weights_equal_hand_bit_for_bit": all(equal),
    }


def _gpt_launch(out: Path, strategy: str, preset: str, ways: tuple[str, ...], extra: tuple[str, ...] = ()) -> str:
    return _try_run(
        [
            *TORCHRUN,
            "--nproc-per-node=2",
            str(GPT_WORKER),
            f"--out={out}",
            f"--strategy={strategy}",
            f"--preset={preset}",
            f"--ways={','.join(ways)}",
            *extra,
        ],
        timeout=1200,
    )


def _why(error: str) -> str:
    """One line of a failed launch: the exception of the rank torchrun names as the root cause, if
    it raised one (the other ranks' errors are only the echo: a peer that went away), else how it ended."""
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", error, re.DOTALL)
    rank = root.group(1) if root else r"\d+"
    raised = re.findall(rf"^\[rank{rank}\]: [\w.]*(?:Error|Exception)\b.*$", error, re.MULTILINE)
    ended = re.findall(rf"failed \(exitcode: -?\d+\) local_rank: {rank}\b", error)
    return (raised or ended or [error.strip().splitlines()[0]])[-1][:200]


def _gpt_round(
    out: Path, strategy: str, preset: str, ways: tuple[str, ...], extra: tuple[str, ...] = ()
) -> tuple[dict, dict, dict]:
    """One launch: (step times per way, peers left out with why, weights.json). A launch that fails
    with peers in it runs again without each peer in turn, then without all of them; the peer whose
    absence let it finish is left out, with one line of what went wrong."""
    error = _gpt_launch(out, strategy, preset, ways, extra)
    left_out = {}
    if error and set(ways) & set(GPT_PEERS):
        why = _why(error)
        peers = [w for w in ways if w in GPT_PEERS]
        print(f"  gpt {strategy}: the launch with {', '.join(peers)} failed ({why}); again without each", flush=True)
        for suspects in [[p] for p in peers] + ([peers] if len(peers) > 1 else []):
            error = _gpt_launch(out, strategy, preset, tuple(w for w in ways if w not in suspects), extra)
            if not error:
                left_out = dict.fromkeys(suspects, f"failed: {why}")
                print(f"  gpt {strategy}: left out {', '.join(suspects)}", flush=True)
                break
    if error:
        sys.exit(error)
    steps = json.loads((out / "steps.json").read_text())
    return steps["step_times"], {**steps["left_out"], **left_out}, json.loads((out / "weights.json").read_text())


def _torchfleet_over(medians: dict[str, list[float]]) -> dict[str, list[float]]:
    """torchfleet / each other way, per round: the ratio of that round's medians, over the rounds both ran."""
    return {
        way: [f / t for f, t in zip(medians["torchfleet"], theirs, strict=True) if f and t]
        for way, theirs in medians.items()
        if way != "torchfleet" and any(theirs)
    }


def gpt_parity(
    rounds: int, out: Path, preset: str, strategies: tuple[str, ...] = GPT_STRATEGIES, extra: tuple[str, ...] = ()
) -> dict:
    """Per strategy and way: step times (medians over rounds of per-round medians), the median per-round
    ratio torchfleet / that way, and the largest difference of its final weights from the hand-written way's."""
    result = {}
    for strategy in strategies:
        ways = GPT_WAYS
        medians: dict[str, list[float]] = {w: [] for w in GPT_WAYS}
        diffs: dict[str, list[float]] = {w: [] for w in GPT_WAYS if w != "hand"}
        moved, left_out = [], {}
        for r in range(rounds):
            times, gone, weights = _gpt_round(out, strategy, preset, ways, extra)
            for way, why in gone.items():
                if way not in left_out:
                    print(f"  gpt {strategy}: {way} left out: {why}", flush=True)
            left_out.update(gone)
            ways = tuple(w for w in ways if w not in gone)  # a peer that failed once sits out the other rounds
            for way in GPT_WAYS:  # 0: not run this round, so per-round lists stay aligned
                medians[way].append(statistics.median(times[way]) if way in times else 0.0)
            for way, d in weights["max_abs_difference"].items():
                diffs[way].append(d)
            moved.append(weights["moved"])
            print(
                f"  gpt {strategy} round {r + 1}/{rounds}: "
                + ", ".join(f"{w} {medians[w][-1] * 1e3:.1f} ms" for w in times)
                + "; weights differ from hand by "
                + ", ".join(f"{w} {d:.1e}" for w, d in weights["max_abs_difference"].items()),
                flush=True,
            )
        ran = {w: [m for m in medians[w] if m] for w in GPT_WAYS}
        per_round = _torchfleet_over(medians)
        result[strategy] = {
            "step_s": {w: statistics.median(m) for w, m in ran.items() if m},
            "per_round_step_s": ran,
            "torchfleet_over": {w: statistics.median(r) for w, r in per_round.items()},
            "torchfleet_over_per_round": per_round,
            "max_weight_difference": {w: max(d) for w, d in diffs.items() if d},
            "weights_moved_by_training": min(moved),
            "left_out": left_out,
        }
    return result


def print_gpt(result: dict, preset: str, versions: dict) -> None:
    print(
        f"gpt {preset}, 2 processes, gloo (torch {versions['torch']}, accelerate {versions['accelerate']},"
        f" lightning {versions['lightning']}): median step time; torchfleet / each way (median of per-round"
        " ratios); largest difference of the final weights from hand-written"
    )
    for strategy, f in result.items():
        print(f"  {strategy}")
        for way in GPT_WAYS:
            if way not in f["step_s"]:
                print(f"    {way:<11} {'—':>9}   {f['left_out'].get(way, 'not run')}")
                continue
            ratio, rounds = "", ""
            if way in f["torchfleet_over"]:
                ratio = f"torchfleet / {way} x{f['torchfleet_over'][way]:.3f}"
                rounds = "per round " + " ".join(f"{r:.2f}" for r in f["torchfleet_over_per_round"][way])
            weights = (
                f"weights within {f['max_weight_difference'][way]:.1e}"
                if way in f["max_weight_difference"]
                else "(the reference)"
                if way == "hand"
                else ""
            )
            print(f"    {way:<11} {f['step_s'][way] * 1e3:6.1f} ms   {ratio:<30} {weights:<22} {rounds}".rstrip())
        print(f"    (training moved the weights by up to {f['weights_moved_by_training']:.1e})")


# id: (what the table calls it, the worker's way, the environment it runs in)
SCALING_WAYS = {
    "hand": ("hand", "hand", None),
    "hand-glibc": ("hand + glibc thresholds", "hand", GLIBC_KEEP),
    "torchfleet": ("torchfleet", "torchfleet", None),
    # What the machine allows (no DDP): independent processes, and processes
    # that meet once per step in a 4-byte all-reduce (parity_worker.unsynced).
    "free": ("free + glibc thresholds", "free", GLIBC_KEEP),
    "lockstep": ("lockstep + glibc thresholds", "lockstep", GLIBC_KEEP),
}


def scaling(
    rounds: int, out: Path, nprocs: tuple[int, ...] = (2,), ways: tuple[str, ...] = tuple(SCALING_WAYS)
) -> dict:
    """Per way and process count n: efficiency = samples/s(n) / (n x samples/s(1)), per round, then the median."""
    per_process = 256
    rates = {(w, n): [] for w in ways for n in (1, *nprocs)}
    for r in range(rounds):
        for nproc in (1, *nprocs):
            for way in ways[r % len(ways) :] + ways[: r % len(ways)]:  # a different way first each round
                _, worker_way, extra_env = SCALING_WAYS[way]
                times = _job(nproc, out, (worker_way,), extra_env, global_batch=per_process * nproc, blocks=12)
                rates[way, nproc].append(per_process * nproc / statistics.median(times[worker_way]))
        print(
            f"  scaling round {r + 1}/{rounds}: "
            + "; ".join(
                f"{w} " + " ".join(f"{rates[w, n][-1] / (n * rates[w, 1][-1]):.3f}" for n in nprocs) for w in ways
            ),
            flush=True,
        )
    result = {}
    for way in ways:
        # Per round, so both figures of a ratio come from the same stretch of time.
        entry = {
            "label": SCALING_WAYS[way][0],
            "samples_per_s": {"1": statistics.median(rates[way, 1])},
            "efficiency": {},
        }
        for n in nprocs:
            entry["samples_per_s"][str(n)] = statistics.median(rates[way, n])
            entry["efficiency"][str(n)] = statistics.median(
                many / (n * one) for one, many in zip(rates[way, 1], rates[way, n], strict=True)
            )
        result[way] = entry
    return result


def print_scaling(result: dict) -> None:
    counts = list(next(iter(result.values()))["efficiency"])
    print("scaling (CNN, 256 samples per process, 1 thread per process): samples/s, efficiency in brackets")
    print(f"  {'way':<28} {'1 process':>10} " + " ".join(f"{n + ' processes':>22}" for n in counts))
    for f in result.values():
        print(
            f"  {f['label']:<28} {f['samples_per_s']['1']:10,.0f} "
            + " ".join(f"{f['samples_per_s'][n]:>13,.0f} ({f['efficiency'][n]:.3f})" for n in counts)
        )


def startup(rounds: int) -> dict:
    commands = {
        "torchfleet run -n 2": [sys.executable, "-m", "torchfleet", "run", "-n", "2", str(FIRST_STEP)],
        "torchrun --nproc-per-node 2": [*TORCHRUN, "--nproc-per-node=2", str(FIRST_STEP)],
    }
    # total: command to end of first step; to_worker: command to rank 0's interpreter being up
    # (the launcher's own start-up and the agent's), the rest is the script's imports and set-up.
    seconds = {name: {"total": [], "to_worker": []} for name in commands}
    with tempfile.TemporaryDirectory() as tmp:
        stamp = Path(tmp) / "stamp"
        for _ in range(rounds):
            for name, cmd in commands.items():
                start = time.time()
                _run([*cmd, str(stamp)])
                worker_up, first_step = map(float, stamp.read_text().split())
                seconds[name]["total"].append(first_step - start)
                seconds[name]["to_worker"].append(worker_up - start)
    a, b = (seconds[n]["total"] for n in commands)
    return {
        "median_s": {n: statistics.median(s["total"]) for n, s in seconds.items()},
        "median_to_worker_s": {n: statistics.median(s["to_worker"]) for n, s in seconds.items()},
        "seconds": seconds,
        "ratio": statistics.median(x / y for x, y in zip(a, b, strict=True)),
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "accelerate": _version("accelerate"),
        "lightning": _version("lightning"),
        "load_average_at_start": os.getloadavg(),
    }


def report(doc: dict) -> None:
    p, s, u = doc["parity"], doc["scaling"], doc["startup"]
    print(
        f"\nparity ({doc['machine']['cpu_cores']} cores, torch {doc['machine']['torch']}, "
        f"{doc['machine']['date']}): CNN, global batch 256, 2 processes, gloo"
    )
    for way in WAYS:
        print(
            f"  {way:<11} {p['median_step_s'][way] * 1e3:8.2f} ms/step   x{p['ratio_to_hand'][way]:.3f} of hand-written"
        )
    print(
        f"  torchfleet's weights equal the hand-written loop's bit for bit: "
        f"{p['torchfleet_weights_equal_hand_bit_for_bit']}"
    )
    print_scaling(s)
    print("start-up (command to end of first training step)")
    for name, sec in u["median_s"].items():
        print(
            f"  {name:<28} {sec:6.2f} s (of which {u['median_to_worker_s'][name]:.2f} s until rank 0's"
            " interpreter was up)"
        )
    print(f"  ratio torchfleet / torchrun: {u['ratio']:.3f}")
    checks = {
        "torchfleet within 1% of hand-written": p["ratio_to_hand"]["torchfleet"] <= 1.01,
        "torchfleet no slower than Accelerate and Fabric": p["ratio_to_hand"]["torchfleet"]
        <= min(p["ratio_to_hand"]["accelerate"], p["ratio_to_hand"]["fabric"]),
        "weights bit for bit": p["torchfleet_weights_equal_hand_bit_for_bit"],
        "scaling efficiency >= 0.90": s["torchfleet"]["efficiency"]["2"] >= 0.90,
        "start-up within 10% of torchrun": u["ratio"] <= 1.10,
    }
    for name, ok in checks.items():
        print(f"  [{'met' if ok else 'MISSED'}] {name}")


def _counts(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        return []
    return counts if counts and min(counts) >= 2 else []


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/parity")
    parser.add_argument("--only", choices=("parity", "scaling", "startup", "gpt"), default=None)
    parser.add_argument("--preset", default="small50m", help="gpt: the built-in gpt's size (default small50m)")
    parser.add_argument("--strategies", default=",".join(GPT_STRATEGIES), help="gpt: which of ddp, fsdp, pipeline")
    parser.add_argument(
        "--blocks",
        type=int,
        default=12,
        help="gpt: blocks of steps each way takes per round, 2 of them warm-up (default 12)",
    )
    parser.add_argument("--block-steps", type=int, default=4, help="gpt: steps in a block (default 4)")
    parser.add_argument("--global-batch", type=int, default=16, help="gpt: sequences per step (default 16)")
    parser.add_argument("--nprocs", default="2", help="scaling: process counts, comma-separated (default 2)")
    parser.add_argument(
        "--scaling-ways",
        default=",".join(SCALING_WAYS),
        help=f"scaling: which ways, comma-separated, of {', '.join(SCALING_WAYS)} (default all)",
    )
    args = parser.parse_args()
    nprocs = tuple(_counts(args.nprocs))
    if not nprocs:
        parser.error(f"--nprocs {args.nprocs!r}: give process counts of 2 or more, comma-separated, e.g. 2,4,8")
    ways = tuple(w for w in args.scaling_ways.split(",") if w)
    unknown = [w for w in ways if w not in SCALING_WAYS]
    if unknown or not ways:
        parser.error(f"--scaling-ways {args.scaling_ways!r}: choose from {', '.join(SCALING_WAYS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine()}
    parts = {
        "parity": lambda: parity(args.rounds, out),
        "scaling": lambda: scaling(args.rounds, out, nprocs, ways),
        "startup": lambda: startup(max(5, args.rounds)),
        "gpt": lambda: gpt_parity(
            args.rounds,
            out,
            args.preset,
            tuple(args.strategies.split(",")),
            (f"--blocks={args.blocks}", f"--block-steps={args.block_steps}", f"--global-batch={args.global_batch}"),
        ),
    }
    for name, part in parts.items():
        if args.only == name or (args.only is None and name != "gpt"):  # gpt only when asked: it is long
            print(f"{name} ...", flush=True)
            doc[name] = part()
    doc["machine"]["load_average_at_end"] = os.getloadavg()
    (out / "parity.json").write_text(json.dumps(doc, indent=2) + "\n")
    if args.only is None:
        report(doc)
    elif args.only == "scaling":
        print_scaling(doc["scaling"])
    elif args.only == "gpt":
        print_gpt(doc["gpt"], args.preset, doc["machine"])
    else:
        print(json.dumps(doc[args.only], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
