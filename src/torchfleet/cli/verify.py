"""The `torchfleet verify` command's flags, and the call from them to verify/run.py."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="train your model a few steps under every strategy that applies and compare each with serial's weights",
        description="Before renting a cluster: your model (a Hugging Face config shrunk to a few layers and a small"
        " width, same architecture, or MODULE:FUNCTION) trains a few SGD steps under each strategy that applies,"
        " on 2 to 8 processes (the GPUs where there are enough, else CPU processes), and each strategy's weights"
        " are compared with one process's. Serial run again with its linear layers summed in two halves says how"
        " far float order alone moves this model. Exit status 1 when a strategy differs beyond that.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--hf-config", metavar="NAME|PATH", help="a config.json's path, or a config plan ships")
    what.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="your own model: FUNCTION returns the model, or (model, make_batch[, loss_fn]), as bench takes it",
    )
    p.add_argument("--strategies", default=None, help="comma-separated (default: every one that applies)")
    p.add_argument("--nproc-per-node", "-n", type=int, default=2, metavar="N", help="processes (default 2)")
    p.add_argument("--steps", type=int, default=5, help="SGD steps a strategy (default 5)")
    p.add_argument("--layers", type=int, default=4, help="--hf-config: decoder blocks kept (default 4)")
    p.add_argument("--width", type=int, default=64, help="--hf-config: hidden size (default 64)")
    p.add_argument("--json-out", default=None, metavar="FILE", help="the table as JSON too")


def command(args) -> int:
    from torchfleet.config import at_least
    from torchfleet.errors import UsageError, choice_error
    from torchfleet.outputs import check_writable_file
    from torchfleet.strategies import registry
    from torchfleet.verify import models, report, run

    if not 2 <= args.nproc_per_node <= 8:
        raise UsageError(f"--nproc-per-node {args.nproc_per_node}: verify runs 2 to 8 processes (default 2)")
    at_least("--steps", args.steps, 1)
    at_least("--layers", args.layers, 2)
    at_least("--width", args.width, 8)
    if args.json_out:
        check_writable_file(args.json_out, "--json-out")
    strategies = None
    if args.strategies:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        for name in strategies:
            if registry.find(name) is None or name == registry.REFERENCE:
                raise choice_error("strategy", name, tuple(n for n in registry.names() if n != registry.REFERENCE))
    if args.hf_config:
        from torchfleet.plan.library_model import read_config

        fields = models.shrink(read_config(args.hf_config), args.layers, args.width)
        name = f"{args.hf_config} ({fields['model_type']}, shrunk to {args.layers} layers of width {args.width})"
        source = models.Source(name, fields=fields)
    else:
        from torchfleet.bench import user_model

        user_model.build(args.model)  # a bad module or function is one sentence here, before any process
        source = models.Source(args.model, function=args.model)
    verdict = run.verify(source, strategies, args.nproc_per_node, args.steps)
    print(report.table(verdict), flush=True)
    if args.json_out:
        report.write_json(verdict, args.json_out)
    return 1 if verdict.differs else 0
