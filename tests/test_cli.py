"""The command line: help, a frozen surface, and bad input as one sentence with status 2."""

import argparse
import shutil

import pytest

from helpers import clean_env, forked_torchfleet, torchfleet, tree_digest
from torchfleet.cli import build_parser
from torchfleet.launcher.torchrun_flags import torchrun_actions

# The whole surface. A new flag or command means editing this list on purpose.
SURFACE = {
    "doctor": ["--json", "--master-addr", "--master-port", "--nnodes", "--node-rank"],
    "train": [
        "--backend",
        "--batch-size",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--data",
        "--tokenizer",
        "--epochs",
        "--preempt-signals",
        "--preempt-notice",
        "--gpt-preset",
        "--grad-accum",
        "--json-out",
        "--lr",
        "--devices",
        "--microbatches",
        "--schedule",
        "--stages-per-process",
        "--pp",
        "--dp-replicate",
        "--dp-shard",
        "--tp",
        "--ep",
        "--experts",
        "--sharing-strategy",
        "--grad-compression",
        "--powersgd-rank",
        "--sync-batchnorm",
        "--sync-every",
        "--outer-lr",
        "--outer-momentum",
        "--master-addr",
        "--master-port",
        "--max-restarts",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--no-preflight",
        "--max-steps",
        "--model",
        "--nnodes",
        "--no-progress",
        "--node-rank",
        "--nproc-per-node",
        "--optimizer",
        "--precision",
        "--resume",
        "--seed",
        "--strategy",
        "--synthetic-size",
        "-n",
        "--hang-timeout",
        "--hf-model",
        "--keep-checkpoints",
        "--resume-fallback",
        "--log-every",
        "--metrics-out",
        "--dashboard",
        "--tensorboard",
        "--fsdp-units",
        "--split-points",
        "--find-unused-parameters",
        "--max-grad-norm",
        "--activation-checkpointing",
        "--compile",
        "--save-model",
        "--fault-tolerance",
        "--lighthouse",
        "--join-timeout",
    ],
    # run: these, in both spellings, and every other flag of the installed torchrun (RUN_TORCHRUN)
    "run": [
        "--master-addr",
        "--master_addr",
        "--master-port",
        "--master_port",
        "--max-restarts",
        "--max_restarts",
        "--nnodes",
        "--node-rank",
        "--node_rank",
        "--nproc-per-node",
        "--nproc_per_node",
        "-n",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        "--rdzv-id",
        "--rdzv_id",
        "--no-preflight",
        "--fault-tolerance",
        "--fault_tolerance",
        "--lighthouse",
        "--join-timeout",
        "--join_timeout",
        "--preempt-signals",
        "--preempt_signals",
        "--preempt-notice",
        "--preempt_notice",
        "--log-every",  # the run's services for a Fleet script (run_services/in_fleet.py): train's names
        "--log_every",
        "--metrics-out",
        "--metrics_out",
        "--dashboard",
    ],
    "lighthouse": ["--host", "--port", "--min-replicas"],
    "k8s": ["--gpus-per-node", "--image", "--nodes", "--nproc-per-node", "--out", "--fault-tolerance"],
    "sagemaker": ["--instance-count", "--instance-type", "--out", "--role", "--submit"],
    "report": ["--out"],
    "plan": [
        "--batch-size",
        "--chart",
        "--check",
        "--cpus-per-node",
        "--gpt-preset",
        "--gpu",
        "--gpus-per-node",
        "--image-size",
        "--intra-link",
        "--json-out",
        "--link",
        "--memory-gb",
        "--mfu",
        "--model",
        "--nodes",
        "--nproc",
        "--optimizer",
        "--precision",
        "--reprobe",
        "--schedule",
        "--stages-per-process",
        "--steps",
        "--strategies",
        "--tflops",
        "--warmup",
        "--hf-config",
        "--seq-len",
        "--decoder-seq-len",
        "--attention",
        "--local-batch",
        "--global-batch",
        "--microbatches",
        "--ac",
        "--tp",
        "--pp",
        "--ep",
        "--ep-dispatch",
        "--compile",
        "--float8",
    ],
    "slurm": [
        "--gpus-per-node",
        "--nodes",
        "--ntasks-per-node",
        "--out",
        "--partition",
        "--submit",
        "--time",
        "--fault-tolerance",
        "--max-restarts",
        "--requeue",
    ],
    "bench": [
        "--batch-sizes",
        "--model",
        "--nproc",
        "--out",
        "--precisions",
        "--quick",
        "--steps",
        "--rounds",
        "--round-time",
        "--compile",
        "--optimizer",
        "--channels-last",
        "--no-channels-last",
        "--gpt-preset",
        "--image-size",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--strategies",
        "--threads",
        "--warmup",
        "--devices",
        "--microbatches",
        "--schedule",
        "--stages-per-process",
        "--pp",
        "--dp-replicate",
        "--dp-shard",
        "--tp",
        "--ep",
        "--experts",
        "--sharing-strategy",
        "--grad-compression",
        "--powersgd-rank",
        "--sync-batchnorm",
        "--sync-every",
        "--outer-lr",
        "--outer-momentum",
        "--fsdp-units",
        "--split-points",
        "--find-unused-parameters",
    ],
    "verify": [
        "--hf-config",
        "--model",
        "--strategies",
        "--nproc-per-node",
        "-n",
        "--steps",
        "--layers",
        "--width",
        "--json-out",
    ],
}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help"))


def _subparsers(parser):
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


RUN_TORCHRUN = {o for a in torchrun_actions() for o in a.option_strings}


def test_surface_is_frozen():
    subs = _subparsers(build_parser())
    assert sorted(subs) == sorted(SURFACE)
    for name, flags in SURFACE.items():
        expected = set(flags) | (RUN_TORCHRUN if name == "run" else set())
        assert _flags(subs[name]) == sorted(expected), name


@pytest.mark.parametrize("command", [[], *[[c] for c in SURFACE]])
def test_every_help(command):
    result = forked_torchfleet(*command, "--help")
    assert result.returncode == 0
    assert "usage: torchfleet" in result.stdout
    for flag in SURFACE.get(command[0], []) if command else []:
        assert flag in result.stdout


BAD = [
    (["train", "--strategy", "warp"], "unknown strategy 'warp'; choose one of auto, serial, hogwild, dp, mp, ddp"),
    (["train", "-n", "0"], "--nproc-per-node 0 must be at least 1"),
    (["train", "--strategy", "ddp", "-n", "4", "--batch-size", "2"], "batch size 2 is smaller than the 4 processes"),
    (["train", "--strategy", "ddp", "-n", "2", "--batch-size", "33"], "does not split evenly among 2 processes"),
    (["train", "--strategy", "serial", "-n", "3"], "strategy 'serial' runs in one process, not 3"),
    (["train", "--epochs", "0"], "--epochs 0 must be at least 1"),
    (["train", "--strategy", "serial", "--pp", "2"], "option 'pp' does not apply to strategy 'serial'"),
    (["train", "--strategy", "hogwild", "--sharing-strategy", "shm"], "unknown sharing strategy 'shm'"),
    (
        ["train", "--strategy", "fsdp+ep", "-n", "4", "--ep", "3"],
        "--ep 3 does not divide the 4 data-parallel processes",
    ),
    (["train", "--strategy", "ep", "-n", "2", "--model", "mlp"], "Sequential has no experts to split"),
    (["train", "--strategy", "mp", "--devices", "cuda:7"], "device cuda:7 in --devices is not visible here"),
    (["train", "--lr", "-1"], "--lr -1.0 must be a positive number"),
    (["train", "--dashboard", "http"], "--dashboard 'http' is not a port; give a number from 1 to 65535"),
    (["train", "--precision", "fp16", "--strategy", "serial"], "fp16 needs a CUDA device"),
    (["train", "--backend", "mpi", "--strategy", "serial"], "no MPI backend"),
    (["train", "--resume"], "--resume needs --checkpoint-dir"),
    (["train", "--resume", "auto"], "--resume needs --checkpoint-dir"),
    (["train", "--resume", "always"], "--resume 'always' is not a choice; give --resume alone"),
    (["train", "--preempt-signals", "TERM,FOO"], "--preempt-signals 'TERM,FOO': FOO is not a signal name"),
    (["train", "--model", "gpt9"], "unknown model 'gpt9'; choose one of mlp, cnn"),
    (["train", "--hf-model", "no/such/dir"], "--hf-model 'no/such/dir' is not a directory"),
    (["train", "--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["train", "--node-rank", "2", "--nnodes", "2"], "--node-rank 2 is out of range for --nnodes 2"),
    (["run", "-n", "2", "no/such/script.py"], "script 'no/such/script.py' does not exist"),
    (["run", "-n", "2", "pyproject.toml"], "is not a Python file"),
    (["run", "--master-port", "70000", "x.py"], "--master-port 70000 is not a TCP port"),
    (["run", "--nnodes", "two", "x.py"], "--nnodes 'two' is not a number of machines like 2 or a range like 1:4"),
    (["run", "--nnodes", "3:1", "x.py"], "--nnodes '3:1' is not a number of machines"),
    (
        ["train", "--strategy", "serial", "--nnodes", "2"],
        "strategy 'serial' runs in one process, not one per machine of --nnodes 2",
    ),
    (
        ["doctor", "--master-addr", "10.0.0.1", "--nnodes", "2", "--node-rank", "2"],
        "give a number of machines and this machine's index below it",
    ),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "--strategies", "serial,warp"], "unknown strategy 'warp'; choose one of serial"),
    (["bench", "--steps", "1"], "--steps 1 must be at least 2"),
    (["bench", "--rounds", "0"], "--rounds 0 must be at least 1"),
    (["bench", "--round-time", "-1"], "--round-time -1 must be a number of seconds, 0 or more"),
    (["bench", "--nproc", "2,x"], "process counts '2,x' is not a comma-separated list"),
    (["bench", "--precisions", "fp64"], "unknown precision 'fp64'"),
    (["verify", "--hf-config", "llama-3.1-8b", "--strategies", "ddp,warp"], "unknown strategy 'warp'; choose one of"),
    (["verify", "--hf-config", "llama-3.1-8b", "-n", "1"], "--nproc-per-node 1: verify runs 2 to 8 processes"),
    (["verify", "--hf-config", "no-such-model"], "--hf-config 'no-such-model' is neither a file nor a shipped config"),
    (["verify", "--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["verify"], "one of the arguments --hf-config --model is required"),
]


@pytest.mark.parametrize("args,sentence", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_sentence_and_status_2(args, sentence, good_checkpoint, tmp_path):
    # Each train row also names a directory holding a good checkpoint: bad input must leave it as it was.
    ckpt = shutil.copytree(good_checkpoint, tmp_path / "ckpt")
    before = tree_digest(ckpt)
    extra = ["--checkpoint-dir", str(ckpt)] if args[0] == "train" and "--resume" not in args else []
    result = forked_torchfleet(*args, *extra, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert sentence in lines[0]
    assert tree_digest(ckpt) == before


def test_unwritable_checkpoint_dir_is_refused_before_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = torchfleet("train", "--strategy", "serial", "--checkpoint-dir", str(blocker / "ckpt"))
    assert result.returncode == 2
    assert "is not writable" in result.stderr and "Traceback" not in result.stderr
    assert blocker.read_text() == "not a directory"  # nothing lost


def test_version():
    result = torchfleet("--version")
    assert result.returncode == 0 and result.stdout.startswith("torchfleet ")


def test_the_real_entry_point_refuses_and_helps_as_the_forked_rows_do():
    """The rows above run in forked children (helpers.forked_torchfleet); here `python -m torchfleet` itself."""
    for args in (["train", "--strategy", "warp"], ["bench", "--steps", "1"], ["train", "--help"]):
        real, forked = torchfleet(*args, timeout=60), forked_torchfleet(*args)
        assert (real.returncode, real.stdout, real.stderr) == (forked.returncode, forked.stdout, forked.stderr)
    assert real.returncode == 0 and "--strategy" in real.stdout


def test_a_forked_row_shows_a_crash_as_a_process_would(tmp_path):
    """So that the rows' `"Traceback" not in stderr` can fail: an uncaught error reaches stderr, status 1."""
    from torchfleet.testing.cli import forked_cli

    result = forked_cli(["--version"], clean_env(), str(tmp_path / "no-such-directory"))  # chdir fails
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "FileNotFoundError" in result.stderr


def test_a_train_option_is_declared_once_on_its_field():
    """TrainConfig's fields are the train flags: parsing nothing gives its defaults, and a new field is a new flag."""
    from dataclasses import dataclass

    from torchfleet.cli.flags import add_flags, from_args
    from torchfleet.config import option
    from torchfleet.train.config import TrainConfig

    assert from_args(TrainConfig, build_parser().parse_args(["train"]), strategy_options={}) == TrainConfig()

    @dataclass
    class Job:
        warmup: int = option(5, "steps before timing (default %(default)s)")
        scale: float | None = option(None, "a factor", metavar="X")
        mode: str = option("fast", "default %(default)s", choices=("fast", "slow"))
        dry_run: bool = option(False, "plan only")
        colour: bool = option(True, "plain output")

    parser = argparse.ArgumentParser(prog="job")
    add_flags(parser, Job)
    assert from_args(Job, parser.parse_args([])) == Job()
    given = parser.parse_args(["--warmup", "7", "--scale", "0.5", "--mode", "slow", "--dry-run", "--no-colour"])
    assert from_args(Job, given) == Job(warmup=7, scale=0.5, mode="slow", dry_run=True, colour=False)
    text = parser.format_help()
    assert "steps before timing (default 5)" in text and "--scale X" in text and "--no-colour" in text

    @dataclass
    class Untyped:
        sizes: tuple = option((1, 2), "sizes")

    with pytest.raises(TypeError, match="Untyped.sizes: a flag of type <class 'tuple'> needs type= or nargs="):
        add_flags(argparse.ArgumentParser(), Untyped)
