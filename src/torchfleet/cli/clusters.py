"""The job-writing commands: `torchfleet slurm`, `torchfleet sagemaker`, `torchfleet k8s`.

Kept apart from cli/__init__.py so the main parser only registers them. Each writes
the file(s) its scheduler takes and prints how to submit them; `--submit`
hands them to the scheduler's own client.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

COMMANDS = ("slurm", "sagemaker", "k8s")


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def _script_args(p: argparse.ArgumentParser, train: bool = True) -> None:
    p.add_argument(
        "script",
        help="the training script (a torchfleet/Fleet script runs unchanged)"
        + (
            ", or train: torchfleet train with the arguments after -- (adding --resume auto where"
            " they give --checkpoint-dir)"
            if train
            else ""
        ),
    )
    p.add_argument("script_args", nargs="*", metavar="-- SCRIPT_ARGS", help="arguments for the script, after --")


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse `COMMAND ...`: torchfleet's flags may come before or after the script
    (`torchfleet slurm train.py --nodes 2`); the script's own arguments follow `--`."""
    args = _PARSERS[argv[0]].parse_intermixed_args(argv[1:])
    args.command, args.version = argv[0], False
    return args


def add_commands(sub) -> None:
    slurm = _PARSERS["slurm"] = sub.add_parser("slurm", help="write (and --submit) an sbatch script for a script")
    slurm.add_argument("--nodes", type=int, default=1, help="nodes to allocate (default 1)")
    slurm.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node; one task each (default 0: a CPU job)"
    )
    slurm.add_argument(
        "--ntasks-per-node", type=int, default=None, help="processes per node (default: one per GPU, else 1)"
    )
    slurm.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's)")
    slurm.add_argument("--time", default=None, help="time limit, e.g. 2:00:00 (default: the partition's)")
    slurm.add_argument(
        "--fault-tolerance",
        default="restart",
        metavar="MODE",
        help="restart (default): one srun step of every process, which ends when one fails;"
        " step: one replica group per node under torchft, each started again when it fails,"
        " the others going on meanwhile (--no-kill keeps the allocation when a node is lost)",
    )
    slurm.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="M",
        help="with --fault-tolerance step: start a failed node's group again at most M times (default 3)",
    )
    slurm.add_argument(
        "--requeue",
        action="store_true",
        help="on SIGUSR1 (sent 120 s before --time) or SIGTERM the job saves a checkpoint, exits 75"
        " and requeues itself, resuming there (SCRIPT train: torchfleet train with"
        " --checkpoint-dir; a script of yours must save and exit 75 itself)",
    )
    slurm.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="where to write the batch script (default SCRIPT.sbatch; - for stdout)",
    )
    slurm.add_argument("--submit", action="store_true", help="submit it with sbatch")
    _script_args(slurm)

    sm = _PARSERS["sagemaker"] = sub.add_parser(
        "sagemaker", help="write (and --submit) a SageMaker training job for a script"
    )
    sm.add_argument(
        "--instance-type",
        default="ml.g5.12xlarge",
        help="e.g. ml.g5.12xlarge (4 GPUs) or ml.c5.2xlarge (CPU); default ml.g5.12xlarge",
    )
    sm.add_argument("--instance-count", type=int, default=1, help="hosts (default 1)")
    sm.add_argument(
        "--role",
        default=None,
        metavar="ARN",
        help="IAM execution role (default: $SAGEMAKER_ROLE or the SDK's, at submit)",
    )
    sm.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="folder for estimator.py and create_training_job.json (default sagemaker-SCRIPT)",
    )
    sm.add_argument(
        "--submit", action="store_true", help="submit it with the SageMaker Python SDK (pip install sagemaker)"
    )
    _script_args(sm, train=False)

    k8s = _PARSERS["k8s"] = sub.add_parser("k8s", help="write a Kubeflow PyTorchJob manifest for a script")
    k8s.add_argument("--nodes", type=int, default=1, help="pods, one per node (default 1)")
    k8s.add_argument("--nproc-per-node", type=int, default=1, help="processes per pod, started by torchrun (default 1)")
    k8s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs each pod asks for (nvidia.com/gpu; default 0)")
    k8s.add_argument(
        "--image", default=None, help="container image holding torchfleet and the script (default torchfleet:latest)"
    )
    k8s.add_argument(
        "--fault-tolerance",
        default="restart",
        metavar="MODE",
        help="restart (default): torchrun in every pod, one rendezvous; step: each pod a replica"
        " group under torchft, meeting at a lighthouse Deployment and Service written alongside;"
        " a failed pod restarts alone and heals from a live peer",
    )
    k8s.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="where to write the manifest (default SCRIPT.pytorchjob.yaml; - for stdout)",
    )
    _script_args(k8s)


def run(args) -> int:
    if args.command == "slurm":
        return _slurm(args)
    if args.command == "k8s":
        return _k8s(args)
    if args.command == "sagemaker":
        return _sagemaker(args)
    raise AssertionError(f"unhandled command {args.command}")


def _slurm(args) -> int:
    from torchfleet.clusters import slurm, write_text
    from torchfleet.errors import UsageError

    job = slurm.SlurmJob(
        args.script,
        args.script_args,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        ntasks_per_node=args.ntasks_per_node,
        partition=args.partition,
        time=args.time,
        fault_tolerance=args.fault_tolerance,
        max_restarts=args.max_restarts,
        requeue=args.requeue,
    )
    text = slurm.batch_script(job)
    if args.out == "-":
        if args.submit:
            raise UsageError("--out - prints the script; --submit needs it in a file, give --out FILE")
        sys.stdout.write(text)
        return 0
    path = write_text(args.out or f"{Path(job.script).stem}.sbatch", text)
    groups = (
        f", a replica group per node, each started again at most {job.max_restarts} times"
        if job.fault_tolerance == "step"
        else ""
    )
    requeue = (
        f", saving on SIG{slurm.REQUEUE_SIGNAL} ({slurm.REQUEUE_SECONDS} s before the time limit) or"
        " SIGTERM and requeueing itself"
        if job.requeue
        else ""
    )
    print(f"wrote {path}: {job.world_size} processes ({job.nodes} x {job.ntasks_per_node}){groups}{requeue}")
    if not args.submit:
        print(f"submit it with: sbatch {path}")
        return 0
    status, said = slurm.submit(path)
    print(said, file=sys.stdout if status == 0 else sys.stderr)
    return status


def _k8s(args) -> int:
    from torchfleet.clusters import kubernetes, write_text

    job = kubernetes.PyTorchJob(
        args.script,
        args.script_args,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        gpus_per_node=args.gpus_per_node,
        image=args.image or kubernetes.DEFAULT_IMAGE,
        fault_tolerance=args.fault_tolerance,
    )
    text = kubernetes.render_all(kubernetes.manifests(job))
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    path = write_text(args.out or f"{Path(job.script).stem}.pytorchjob.yaml", text)
    print(
        f"wrote {path}: PyTorchJob {job.name}, {job.world_size} processes "
        f"({job.nodes} pod(s) x {job.nproc_per_node})"
        + (
            f", one replica group each; the lighthouse's Deployment and Service {job.lighthouse}"
            if job.fault_tolerance == "step"
            else ""
        )
    )
    if args.image is None:
        held = "torchfleet" if job.train is not None else f"torchfleet and {job.script}"
        print(f"note: the image {kubernetes.DEFAULT_IMAGE} must hold {held}; build yours and pass --image")
    print(f"submit it with: kubectl apply -f {path}")
    return 0


def _sagemaker(args) -> int:
    import json

    from torchfleet.clusters import sagemaker, write_text

    job = sagemaker.SageMakerJob(
        args.script,
        args.script_args,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        role=args.role,
    )
    folder = Path(args.out or f"sagemaker-{Path(job.script).stem}")
    estimator = write_text(folder / "estimator.py", sagemaker.estimator_source(job))
    request = sagemaker.create_training_job_request(job)
    write_text(folder / "create_training_job.json", json.dumps(request, indent=2) + "\n")
    launch = "torchrun on each host" if job.distribution else "one process per host"
    print(
        f"wrote {estimator} and create_training_job.json: {job.processes} processes "
        f"({job.instance_count} x {job.instance_type}, {launch})"
    )
    if not args.submit:
        print(f"submit it with: python {estimator}   (needs `pip install sagemaker` and AWS credentials)")
        return 0
    return sagemaker.submit(estimator)
