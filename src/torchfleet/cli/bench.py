"""The `torchfleet bench` command's flags, and the call from flags to `bench.run_bench`.

Flags left out are chosen for this machine (see bench.resolve); `--quick`
picks a tiny matrix (bench.QUICK) for flags not given.
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
    from torchfleet.train.models import GPT_PRESETS, MODELS

    b = sub.add_parser("bench", help="every strategy that can run here, side by side: table, JSON, chart")
    b.add_argument("--model", default=None, metavar="NAME",
                   help=f"a built-in model ({', '.join(MODELS)}; default cnn), or MODULE:FUNCTION returning"
                   " your own: the model, or (model, make_batch[, loss_fn]) with make_batch(n) -> (inputs, targets)")
    b.add_argument("--gpt-preset", choices=tuple(GPT_PRESETS), default=None,
                   help="--model gpt's size: tiny, small50m or gpt2 (default gpt2 with GPUs, tiny without);"
                   " its batches are random tokens and the table reports tokens/s")
    b.add_argument("--image-size", type=int, default=None, metavar="PIXELS",
                   help="--model resnet18/resnet50: mock images are 3 x PIXELS x PIXELS (default 224)")
    b.add_argument("--strategies", type=_list(str, "strategies"), default=None,
                   help="comma-separated (default: every strategy doctor finds available; serial always)")
    b.add_argument("--nproc", type=_list(int, "process counts"), default=None,
                   help="process counts for multi-process strategies, e.g. 2,4 (default 2, or the GPU count)")
    b.add_argument("--batch-sizes", type=_list(int, "batch sizes"), default=None,
                   help="GLOBAL batch sizes, e.g. 64,512 (default by model and device)")
    b.add_argument("--precisions", type=_list(str, "precisions"), default=None,
                   help="e.g. fp32,bf16 (default fp32 on CPU; fp32,bf16,fp16 on CUDA)")
    b.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    b.add_argument("--steps", type=int, default=None, help="timed steps (default 30)")
    b.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per process (default: usable cores / processes)")
    b.add_argument("--out", default="runs/bench", metavar="DIR",
                   help="where results.json, results.csv and bench.png go (default runs/bench)")
    b.add_argument("--quick", action="store_true",
                   help="a tiny matrix (mlp, batch 64, 6 steps; gpt tiny, 32x32 images): a smoke test")
    opts = b.add_argument_group("strategy options (each strategy gets those it takes)")
    for flag, kind, text in strategy_flags:  # a bool is a switch: given means True
        opts.add_argument(flag, **({"action": "store_true"} if kind is bool else {"type": kind}),
                          default=None, help=text)


def command(args, strategy_options: dict) -> int:
    from torchfleet.bench.config import BenchConfig
    from torchfleet.bench.matrix import QUICK, run_bench

    given = {name: getattr(args, name) for name in
             ("model", "gpt_preset", "image_size", "strategies", "nproc", "batch_sizes", "precisions", "warmup",
              "steps")}
    chosen = {**(QUICK if args.quick else {}), **{k: v for k, v in given.items() if v is not None}}
    cfg = BenchConfig(**chosen, threads=args.threads, out=args.out, strategy_options=strategy_options)
    document = run_bench(cfg)
    return 0 if any(c["status"] == "ok" for c in document["cells"]) else 1
