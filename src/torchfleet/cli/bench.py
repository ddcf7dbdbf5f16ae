"""The `torchfleet bench` command's flags, and the call from flags to `bench.run_bench` or, given node
flags, to link mode's `run_link_bench` (bench/link).

Flags left out are chosen for this machine (see bench.resolve); `--quick`
picks a tiny matrix (bench.QUICK) for flags not given. Link mode has its
own defaults (bench/link/job.py).
"""

from __future__ import annotations

import argparse


def _list(kind, what: str):
    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not a comma-separated list") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is empty")
        return values

    return parse


def add_parser(sub, strategy_flags) -> None:
    from torchfleet.bench.config import MAX_ROUND_STEPS, ROUND_TIME_S
    from torchfleet.strategies.block_transforms import COMPILE_MODES
    from torchfleet.train.models import GPT_PRESETS, MODELS

    b = sub.add_parser(
        "bench",
        help="every strategy that can run here, side by side: table, JSON, chart; with --nnodes, ddp,"
        " PowerSGD and diloco over the link between machines",
        description="On one machine: every strategy doctor finds available, side by side (diloco and localsgd"
        " pay only over a slow link between machines, so they are measured in link mode). Link mode: run the"
        " same command on every machine with --nnodes N --node-rank R --master-addr A, e.g. torchfleet bench"
        " --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 (--node-rank 1 on the other): it measures the link's"
        " Mbit/s with an all-reduce of 4 MiB, runs ddp, ddp with PowerSGD and diloco (one process per machine,"
        " gpt tiny on random tokens, the same global batch and timed steps) and node 0 says which wins on this"
        " link and by how much, and writes results.json.",
    )
    b.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help=f"a built-in model ({', '.join(MODELS)}; default cnn, gpt in link mode), or MODULE:FUNCTION returning"
        " your own: the model, or (model, make_batch[, loss_fn]) with make_batch(n) -> (inputs, targets)",
    )
    b.add_argument(
        "--gpt-preset",
        choices=tuple(GPT_PRESETS),
        default=None,
        help="--model gpt's size: tiny, small50m or gpt2 (default gpt2 with GPUs, tiny without and in"
        " link mode);"
        " its batches are random tokens and the table reports tokens/s",
    )
    b.add_argument(
        "--image-size",
        type=int,
        default=None,
        metavar="PIXELS",
        help="--model resnet18/resnet50: mock images are 3 x PIXELS x PIXELS (default 224)",
    )
    b.add_argument(
        "--strategies",
        type=_list(str, "strategies"),
        default=None,
        help="comma-separated (default: every strategy doctor finds available but diloco and"
        " localsgd; serial always); pipeline/SCHEDULE adds the pipeline under another schedule,"
        " e.g. pipeline/interleaved-1f1b or pipeline/zbv (2 stages per process). Link mode: of ddp, powersgd, diloco, localsgd (default"
        " ddp,powersgd,diloco; ddp always)",
    )
    b.add_argument(
        "--nproc",
        type=_list(int, "process counts"),
        default=None,
        help="process counts for multi-process strategies, e.g. 2,4 (default 2, or the GPU count)",
    )
    b.add_argument(
        "--batch-sizes",
        type=_list(int, "batch sizes"),
        default=None,
        help="GLOBAL batch sizes, e.g. 64,512 (default by model and device; link mode: one, default 32)",
    )
    b.add_argument(
        "--precisions",
        type=_list(str, "precisions"),
        default=None,
        help="e.g. fp32,bf16 (default fp32 on CPU; fp32,bf16,fp16 on CUDA)",
    )
    b.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first (default 5; link mode 10, whole blocks of --sync-every)",
    )
    b.add_argument(
        "--steps",
        type=int,
        default=None,
        help="the fewest timed steps in each round of a cell, which times more where they take less than"
        " --round-time (default 30; link mode: exactly these, default 50, whole blocks of --sync-every, at least"
        " two)",
    )
    b.add_argument(
        "--round-time",
        type=float,
        default=None,
        metavar="SECONDS",
        help="each round of a cell times as many steps as take this many seconds at their median, so a 0.4 ms"
        f" step gets hundreds and a 200 ms step just --steps; at most {MAX_ROUND_STEPS} steps; 0: exactly --steps"
        f" (default {ROUND_TIME_S:g})",
    )
    b.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of the whole matrix, each cell once per round, interleaved so that load that comes and"
        " goes hits every cell alike; a cell's figure is the median of its rounds', and the fastest is named"
        " only when it beats the others in every round (default 3)",
    )
    b.add_argument(
        "--threads", type=int, default=None, help="intra-op threads per process (default: usable cores / processes)"
    )
    b.add_argument(
        "--out",
        default="runs/bench",
        metavar="DIR",
        help="where results.json, results.csv and bench.png go (default runs/bench); link mode:"
        " results.json on node 0, each machine's cell logs in DIR/logs",
    )
    b.add_argument(
        "--compile",
        nargs="?",
        const="blocks",
        choices=COMPILE_MODES,
        default=None,
        help="torch.compile each block (--compile alone) or the whole model in every cell; the warm-up"
        " steps take the compilation, and each row gives its first step's seconds",
    )
    b.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        default="sgd",
        help="what every cell steps with: sgd (momentum 0.9, the default) or adamw (fused on a GPU)",
    )
    b.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="convolution weights and image batches in NHWC memory (default: on in bf16 and fp16 on a GPU,"
        " where cuDNN's fast kernels want it; off otherwise)",
    )
    b.add_argument(
        "--quick",
        action="store_true",
        help=f"a tiny matrix (mlp, batch 64, 5 rounds of at least 6 steps and {ROUND_TIME_S:g} s; gpt tiny, 32x32"
        " images): a smoke test; link mode: 20 timed steps",
    )
    link = b.add_argument_group(
        "link mode: the same command on every machine; ddp, ddp with PowerSGD and diloco over the link between"
        " them (--sync-every: diloco's steps between meetings, default 10 here; --powersgd-rank, default 2)"
    )
    link.add_argument("--nnodes", default=None, metavar="N", help="machines taking part, 2 or more")
    link.add_argument("--node-rank", type=int, default=None, help="this machine's index, 0 to N-1 (default 0)")
    link.add_argument("--master-addr", default=None, help="node 0's address, which every machine reaches")
    link.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="node 0's port for the bench's store (default 29500); each cell uses one of the next"
        " ports, so they must be free and reachable too",
    )
    opts = b.add_argument_group("strategy options (each strategy gets those it takes)")
    for flag, kind, text in strategy_flags:  # a bool is a switch: given means True
        opts.add_argument(
            flag, **({"action": "store_true"} if kind is bool else {"type": kind}), default=None, help=text
        )


def command(args, strategy_options: dict) -> int:
    from torchfleet.bench.config import BenchConfig
    from torchfleet.bench.link.job import machines_from_flags
    from torchfleet.bench.matrix import QUICK, run_bench
    from torchfleet.errors import UsageError

    given = {
        name: getattr(args, name)
        for name in (
            "model",
            "gpt_preset",
            "image_size",
            "strategies",
            "nproc",
            "batch_sizes",
            "precisions",
            "warmup",
            "steps",
            "rounds",
            "round_time",
        )
    }
    given["round_time_s"] = given.pop("round_time")
    machines = machines_from_flags(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    if machines is not None:
        if given.pop("rounds") is not None:
            raise UsageError("--rounds is for the matrix on one machine; link mode times each cell once per machine")
        if given.pop("round_time_s") is not None:
            raise UsageError("--round-time is for the matrix on one machine; link mode times exactly --steps")
        return _link_mode(args, given, strategy_options, machines)
    chosen = {**(QUICK if args.quick else {}), **{k: v for k, v in given.items() if v is not None}}
    cfg = BenchConfig(
        **chosen,
        threads=args.threads,
        out=args.out,
        strategy_options=strategy_options,
        compile=args.compile,
        optimizer=args.optimizer,
        channels_last=args.channels_last,
    )
    document = run_bench(cfg)
    return 0 if any(c["status"] == "ok" for c in document["cells"]) else 1


def _link_mode(args, given: dict, strategy_options: dict, machines) -> int:
    from torchfleet.bench.link.job import job_from_flags
    from torchfleet.bench.link.run import run_link_bench
    from torchfleet.config import at_least

    if args.threads is not None:
        at_least("--threads", args.threads, 1)
    plan, notes = job_from_flags(given, strategy_options, machines.nnodes, quick=args.quick)
    document = run_link_bench(plan, machines, args.out, threads=args.threads, notes=notes)
    # On node 0 every machine's cells; on the others their own part of each.
    return 0 if any(c["status"] == "ok" for c in document["cells"]) else 1
