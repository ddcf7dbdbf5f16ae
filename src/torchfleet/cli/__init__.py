"""The `torchfleet` command: parse, build typed config, call one function.

Flags follow torchrun's names where torchrun has one. Bad input is one
sentence on stderr and exit status 2; a traceback means a bug in torchfleet.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from torchfleet.errors import TrainingError, UsageError

EPILOG = "Docs: docs/ in the repository (make docs builds the site). Every command takes --help."


def _strategy_flags() -> list[tuple[str, type, str]]:
    """Flags passed to the strategy only when given; a strategy rejects those it does not take. Declared once,
    with their help and their family, in strategies/options.py."""
    from torchfleet.strategies.options import flags

    return flags()


def _strategy_options(args) -> dict:
    names = (flag[2:].replace("-", "_") for flag, _, _ in _strategy_flags())
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line (no usage dump) with status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's name
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_launch_flags(p: argparse.ArgumentParser, underscores: bool = False) -> None:
    """torchrun's process flags; `underscores` adds torchrun's other spelling (--nproc_per_node)."""
    g = p.add_argument_group("processes (torchrun's flags)")
    both = _spellings(underscores)
    g.add_argument(
        *both("--nproc-per-node"),
        "-n",
        type=int,
        default=None,
        metavar="N",
        help="processes on this machine (default: train picks; run uses 1)",
    )
    _add_node_flags(g, underscores)
    g.add_argument(
        *both("--max-restarts"),
        type=int,
        default=0,
        help="restart the whole group this many times after a failure (default 0)",
    )
    g.add_argument(
        *both("--rdzv-endpoint"),
        default=None,
        metavar="HOST:PORT",
        help="c10d rendezvous for an elastic job (--nnodes MIN:MAX); run the same on every machine",
    )
    g.add_argument(*both("--rdzv-id"), default=None, help="the job's id, the same on every machine (c10d)")
    g.add_argument(
        "--no-preflight", action="store_true", help="skip the checks of the other machines before a multi-machine job"
    )
    f = p.add_argument_group("surviving a lost machine (torchft)")
    f.add_argument(
        *both("--fault-tolerance"),
        default="restart",
        metavar="MODE",
        help="restart (default): torchrun restarts the workers, which resume from the newest"
        " checkpoint; step: each machine is a replica group under torchft, the others go on at"
        " the next step and a group started again heals from a live peer (pip install"
        " 'torchfleet[ft]')",
    )
    f.add_argument(
        "--lighthouse",
        default=None,
        metavar="HOST:PORT",
        help="with --fault-tolerance step: a lighthouse started elsewhere (torchfleet lighthouse);"
        " default: node 0 starts one at --master-addr and --master-port (29510)",
    )
    f.add_argument(
        *both("--join-timeout"),
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="with --fault-tolerance step: how long a group waits for the others at the start, or"
        " to complete a step, before it stops (default %(default).0f)",
    )


def _spellings(underscores: bool):
    return lambda flag: (flag, flag.replace("-", "_").replace("__", "--", 1)) if underscores else (flag,)


def _add_node_flags(g, underscores: bool = False) -> None:
    both = _spellings(underscores)
    g.add_argument("--nnodes", default="1", help="machines taking part: N, or MIN:MAX for an elastic job (default 1)")
    g.add_argument(*both("--node-rank"), type=int, default=0, help="this machine's index, 0 to nnodes-1")
    g.add_argument(*both("--master-addr"), default="127.0.0.1", help="address of node 0 (many machines)")
    g.add_argument(
        *both("--master-port"),
        type=int,
        default=None,
        help="port of node 0's rendezvous (default: a free port on one machine, 29500 on many)",
    )


def build_parser() -> argparse.ArgumentParser:
    from torchfleet.cli.flags import add_flags
    from torchfleet.train.config import TrainConfig

    parser = _Parser(
        prog="torchfleet",
        description="Train one PyTorch model on one process, many processes, many devices or many machines.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    doctor = sub.add_parser("doctor", help="what this machine has, which backend and why")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_node_flags(
        doctor.add_argument_group(
            "many machines: with --master-addr, show the interface to it; with --master-port too, run the preflight"
        )
    )

    train = sub.add_parser("train", help="train the built-in job (a CNN on digits by default)")
    add_flags(train, TrainConfig)
    opts = train.add_argument_group("strategy options (each applies to some strategies only)")
    for flag, kind, text in _strategy_flags():  # a bool is a switch: given means True
        how: dict[str, Any] = {"action": "store_true"} if kind is bool else {"type": kind}
        opts.add_argument(flag, **how, default=None, help=text)
    _add_launch_flags(train)

    from torchfleet.launcher.torchrun_flags import add_torchrun_flags

    run = sub.add_parser("run", help="run any script on N processes (every torchrun flag, both spellings)")
    _add_launch_flags(run, underscores=True)
    add_torchrun_flags(run)
    leaving = run.add_argument_group("leaving when told to (the script asks fleet.preempted(), saves, fleet.leave())")
    leaving.add_argument(
        "--preempt-signals",
        "--preempt_signals",
        default="TERM,USR1",
        metavar="SIGNALS",
        help="signals the launcher passes on to the workers and their Fleet listens for;"
        " comma-separated, or none (default %(default)s)",
    )
    leaving.add_argument(
        "--preempt-notice",
        "--preempt_notice",
        default="none",
        metavar="SOURCE",
        help="also a spot instance's notice, polled every 5 s by one process per machine: aws,"
        " gcp, azure, or an http:// URL whose answer 200 with a body is the notice"
        " (default %(default)s)",
    )
    services = run.add_argument_group(
        "the run's services for a Fleet script's train_step (several processes): each rank's phases, stragglers named"
    )
    services.add_argument(
        "--log-every",
        "--log_every",
        type=int,
        default=10,
        metavar="N",
        help="read every rank's figures every N"
        " steps; a straggler is named after 3 slow reads in a row (default %(default)s)",
    )
    services.add_argument(
        "--metrics-out",
        "--metrics_out",
        metavar="FILE",
        help="each rank's data, compute and communication seconds"
        " and memory per read, and any straggler named: FILE.csv or FILE.jsonl (written by the main rank)",
    )
    services.add_argument(
        "--dashboard",
        nargs="?",
        const="8050",
        metavar="PORT",
        help="serve a page of every rank's figures while"
        " the script trains, on 127.0.0.1:PORT only (default 8050; 0: any free port); needs torchfleet[dashboard]",
    )
    run.add_argument(
        "script", help="the Python script to run on every rank (a module with -m, a program with --no-python)"
    )
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    lighthouse = sub.add_parser("lighthouse", help="run torchft's lighthouse for jobs under --fault-tolerance step")
    lighthouse.add_argument(
        "--host",
        required=True,
        metavar="ADDR",
        help="this machine's address the replica groups reach (it listens there only)",
    )
    lighthouse.add_argument("--port", type=int, default=29510, help="default %(default)s")
    lighthouse.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        metavar="N",
        help="groups that make a quorum (default %(default)s: the job goes on while any lives)",
    )

    from torchfleet.cli import clusters as clusters_cli

    clusters_cli.add_commands(sub)  # slurm, sagemaker, k8s: writers of job specs

    from torchfleet.cli import bench as bench_cli

    bench_cli.add_parser(sub, _strategy_flags())

    from torchfleet.cli import plan as plan_cli

    plan_cli.add_parser(sub)

    from torchfleet.cli import report as report_cli

    report_cli.add_parser(sub)

    from torchfleet.cli import verify as verify_cli

    verify_cli.add_parser(sub)
    return parser


def _launch_config(args):
    from torchfleet.config import LaunchConfig

    return LaunchConfig(
        nproc_per_node=args.nproc_per_node if args.nproc_per_node is not None else 1,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        preflight=not args.no_preflight,
        fault_tolerance=args.fault_tolerance,
        lighthouse=args.lighthouse,
        join_timeout=args.join_timeout,
    )


def cmd_doctor(args) -> int:
    from torchfleet.doctor import print_doctor

    if args.master_addr == "127.0.0.1" and args.master_port is None:
        return print_doctor(json_out=args.json)
    from torchfleet.launcher.host_report import print_multinode

    # doctor takes a plain N (no elastic MIN:MAX): the preflight compares a fixed set of nodes.
    nnodes = args.nnodes.strip()
    if not nnodes.isdigit() or not 0 <= args.node_rank < int(nnodes):
        raise UsageError(
            f"doctor --nnodes {nnodes!r} --node-rank {args.node_rank}: give a number of"
            " machines and this machine's index below it, e.g. --nnodes 2 --node-rank 1"
        )
    return print_multinode(args.master_addr, args.master_port, int(nnodes), args.node_rank, json_out=args.json)


def cmd_train(args, argv: list[str]) -> int:
    from torchfleet.cli.flags import from_args
    from torchfleet.train import command
    from torchfleet.train.config import TrainConfig

    cfg = from_args(TrainConfig, args, strategy_options=_strategy_options(args))
    return command.run(cfg, _launch_config(args), args.nproc_per_node, argv)


def cmd_run(args) -> int:
    from torchfleet.launcher import torchrun_flags
    from torchfleet.launcher.agent import run_script
    from torchfleet.launcher.environ import exported
    from torchfleet.launcher.preempt_relay import parse_signals
    from torchfleet.run_services.in_fleet import RunOptions
    from torchfleet.worker.spot_notices import check_spec

    parse_signals(args.preempt_signals)  # refused here, before any process starts
    check_spec(args.preempt_notice)
    services = RunOptions(args.log_every, args.metrics_out, args.dashboard)  # the workers' Fleet reads them
    if args.dashboard is not None and args.node_rank == 0:
        from torchfleet.train.config import check_dashboard

        check_dashboard(args.dashboard)
    with exported(services.exported()):
        return run_script(
            _launch_config(args),
            args.script,
            args.script_args,
            torchrun_flags.given(args),
            preempt_signals=args.preempt_signals,
            preempt_notice=args.preempt_notice,
        )


def cmd_lighthouse(args) -> int:
    from torchfleet.config import at_least
    from torchfleet.replica_groups import lighthouse, torchft_setup

    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a TCP port; use 1 to 65535")
    at_least("--min-replicas", args.min_replicas, 1)
    reason = torchft_setup.unavailable()
    if reason:
        raise UsageError(f"the lighthouse cannot run here: {reason}")
    return lighthouse.serve(args.host, args.port, args.min_replicas)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    from torchfleet.cli import clusters as clusters_cli

    if argv and argv[0] in clusters_cli.COMMANDS:
        args = clusters_cli.parse(argv)  # flags may also follow the script there
    else:
        args, extra = parser.parse_known_args(argv)
        if extra:  # the hint names the command's own help, where its flags are
            commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
            (commands.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.version:
        from torchfleet import __version__

        print(f"torchfleet {__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "doctor":
            return cmd_doctor(args)
        if args.command == "train":
            return cmd_train(args, argv[argv.index("train") + 1 :])
        if args.command == "run":
            return cmd_run(args)
        if args.command == "lighthouse":
            return cmd_lighthouse(args)
        if args.command in clusters_cli.COMMANDS:
            return clusters_cli.run(args)
        if args.command == "bench":
            from torchfleet.cli import bench as bench_cli

            return bench_cli.command(args, _strategy_options(args))
        if args.command == "plan":
            from torchfleet.cli import plan as plan_cli

            return plan_cli.command(args)
        if args.command == "report":
            from torchfleet.cli import report as report_cli

            return report_cli.command(args)
        if args.command == "verify":
            from torchfleet.cli import verify as verify_cli

            return verify_cli.command(args)
    except UsageError as exc:
        print(f"torchfleet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        print(f"torchfleet {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
