"""Every row of docs/reference/errors.md: one sentence, exit status 2 (or UsageError), no traceback, nothing lost.

The command-line rows run `torchfleet.cli.main` in this process (the same code
a subprocess would run, without paying for a fresh interpreter each time);
rows whose error comes from worker processes run the real command.
tests/test_cli.py's BAD list holds the older rows; the table names both.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import test_outputs
from helpers import _CLUSTER_VARS, ROOT, require_system, torchfleet, tree_digest
from test_cli import BAD
from torchfleet import Fleet, UsageError, cli
from torchfleet.config import LaunchConfig
from torchfleet.data import GlobalBatchSampler
from torchfleet.env import DistEnv
from torchfleet.launcher.ports import wait_for_master
from torchfleet.netif import free_port
from torchfleet.strategies import registry
from torchfleet.train.config import TrainConfig
from torchfleet.train.datasets import synthetic

SCRIPT = str(ROOT / "tests" / "scripts" / "crash.py")
JOB = [
    "train",
    "--strategy",
    "serial",
    "--model",
    "mlp",
    "--data",
    "synthetic",
    "--synthetic-size",
    "256",
    "--no-progress",
    "--hang-timeout",
    "0",
]


@dataclass
class Row:
    id: str
    argv: list[str] | None  # CLI rows; "{ckpt}" is the directory holding a good checkpoint
    sentence: str
    setup: str | None = None  # name of a setup in SETUPS
    env: dict = field(default_factory=dict)
    subprocess: bool = False  # the error comes from worker processes: run the real command


def _state(ckpt: Path) -> Path:
    return next(ckpt.glob("step-*/state.pt"))


def _flip_byte(ckpt: Path) -> None:
    data = bytearray(_state(ckpt).read_bytes())
    data[len(data) // 2] ^= 0xFF
    _state(ckpt).write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    _state(ckpt).write_bytes(_state(ckpt).read_bytes()[:1000])


def _drop_manifest(ckpt: Path) -> None:
    next(ckpt.glob("step-*/manifest.json")).unlink()


def _mount(args: list[str]) -> None:
    try:
        subprocess.run(args, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        require_system(
            f"mount is not permitted here ({getattr(exc, 'stderr', b'') or exc!s}); it needs root"
            " in a container that allows mounts"
        )


def _read_only(ckpt: Path, cleanups: list) -> None:
    _mount(["mount", "--bind", str(ckpt), str(ckpt)])
    cleanups.append(["umount", str(ckpt)])
    _mount(["mount", "-o", "remount,bind,ro", str(ckpt)])


def _full(ckpt: Path, cleanups: list) -> None:
    # A tmpfs with room for the checkpoint it holds and not for a second one.
    saved = ckpt.with_name("saved")
    shutil.move(ckpt, saved)
    ckpt.mkdir()
    _mount(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(ckpt)])
    cleanups.append(["umount", str(ckpt)])
    shutil.copytree(saved, ckpt, dirs_exist_ok=True)


SETUPS = {"flip": _flip_byte, "truncate": _truncate, "no-manifest": _drop_manifest}
MOUNTS = {"read-only": _read_only, "full": _full}

ROWS = [
    Row("unknown-backend", ["train", "--backend", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
    Row(
        "accumulation-does-not-divide",
        [*JOB, "--batch-size", "64", "--grad-accum", "3", "--checkpoint-dir", "{ckpt}"],
        "does not split into 3 accumulation steps",
    ),
    Row(
        "batch-larger-than-data",
        [*JOB, "--synthetic-size", "100", "--batch-size", "128", "--checkpoint-dir", "{ckpt}"],
        "batch size 128 is larger than the data set (100 samples)",
    ),
    Row(
        "negative-checkpoint-interval",
        [*JOB, "--checkpoint-every", "-1", "--checkpoint-dir", "{ckpt}"],
        "--checkpoint-every -1 must be at least 0",
    ),
    Row(
        "keep-zero-checkpoints",
        [*JOB, "--keep-checkpoints", "0", "--checkpoint-dir", "{ckpt}"],
        "--keep-checkpoints 0 must be at least 1",
    ),
    Row(
        "negative-hang-timeout",
        ["train", "--hang-timeout", "-5", "--checkpoint-dir", "{ckpt}"],
        "--hang-timeout -5.0 must be 0 (off) or a positive number",
    ),
    Row(
        "negative-restarts",
        ["train", "--max-restarts", "-1", "--checkpoint-dir", "{ckpt}"],
        "--max-restarts -1 must be at least 0",
    ),
    Row(
        "zero-nodes",
        ["train", "--strategy", "ddp", "--nnodes", "0", "--checkpoint-dir", "{ckpt}"],
        "--nnodes '0' is not a number of machines like 2 or a range like 1:4",
    ),
    Row(
        "zero-max-steps",
        ["train", "--max-steps", "0", "--checkpoint-dir", "{ckpt}"],
        "--max-steps 0 must be at least 1",
    ),
    Row(
        "zero-batch", ["train", "--batch-size", "0", "--checkpoint-dir", "{ckpt}"], "--batch-size 0 must be at least 1"
    ),
    Row("fallback-without-directory", ["train", "--resume-fallback"], "--resume-fallback needs --checkpoint-dir"),
    Row(
        "corrupt-checkpoint",
        [*JOB, "--resume", "--checkpoint-dir", "{ckpt}"],
        "state.pt' is corrupt or truncated: its sha256 does not match manifest.json; pass --resume-fallback",
        setup="flip",
    ),
    Row(
        "truncated-checkpoint",
        [*JOB, "--resume", "--checkpoint-dir", "{ckpt}"],
        "state.pt' is corrupt or truncated",
        setup="truncate",
    ),
    Row(
        "incomplete-checkpoint",
        [*JOB, "--resume", "--checkpoint-dir", "{ckpt}"],
        "has no manifest.json: it is incomplete or not a torchfleet checkpoint",
        setup="no-manifest",
    ),
    Row(
        "no-intact-checkpoint-left",
        [*JOB, "--resume-fallback", "--checkpoint-dir", "{ckpt}"],
        "none of the 1 checkpoints in",
        setup="flip",
    ),
    Row(
        "checkpoint-of-another-model",
        [*JOB[:4], "cnn", *JOB[5:], "--resume", "--checkpoint-dir", "{ckpt}"],
        "holds a different model: this model's 0.bias [32] is not in it",
    ),
    Row(
        "checkpoint-of-another-optimizer",
        [*JOB, "--optimizer", "sgd", "--resume", "--checkpoint-dir", "{ckpt}"],
        "was saved with optimizer AdamW and this run uses SGD",
    ),
    Row(
        "read-only-checkpoint-directory",
        [*JOB, "--checkpoint-dir", "{ckpt}"],
        "is not writable (Read-only file system)",
        setup="read-only",
    ),
    Row(
        "full-checkpoint-directory",
        [*JOB, "--resume", "--checkpoint-every", "1", "--max-steps", "3", "--checkpoint-dir", "{ckpt}"],
        "(No space left on device); the earlier checkpoints are untouched",
        setup="full",
    ),
    Row(
        "malformed-launcher-variable",
        ["train", "--checkpoint-dir", "{ckpt}"],
        "RANK='first' is not an integer",
        env={"RANK": "first", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
    ),
    Row(
        "unknown-allocator-choice",
        [*JOB, "--checkpoint-dir", "{ckpt}"],
        "TORCHFLEET_MALLOC='jemalloc' is not a choice; use keep (the default) or default",
        env={"TORCHFLEET_MALLOC": "jemalloc"},
    ),
    Row(
        "mesh-does-not-multiply-out",
        [
            "train",
            "--strategy",
            "ddp+pipeline",
            "-n",
            "3",
            "--pp",
            "2",
            "--batch-size",
            "66",
            "--checkpoint-dir",
            "{ckpt}",
        ],
        "dp_replicate(1) * dp_shard(1) * pp(2) != 3 processes",
    ),
    Row("run-zero-processes", ["run", "-n", "0", SCRIPT], "--nproc-per-node 0 must be at least 1"),
    Row("port-in-use", ["run", "-n", "2", "--master-port", "{busy_port}", SCRIPT], "is already in use on 127.0.0.1"),
    Row(
        "unresolvable-master",
        [
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "no-such-host.invalid",
            "--master-port",
            "29400",
            SCRIPT,
        ],
        "--master-addr 'no-such-host.invalid' cannot be resolved",
    ),
]


def _in_process(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.timeout(240)
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_cli_row(row: Row, good_checkpoint, tmp_path, capsys, monkeypatch):
    if row.id == "mesh-does-not-multiply-out" and registry.find("ddp+pipeline") is None:
        pytest.skip("ddp+pipeline strategy not registered on this branch")
    ckpt = shutil.copytree(good_checkpoint, tmp_path / "ckpt")
    cleanups: list = []
    busy = socket.socket()
    try:
        if row.setup in MOUNTS:
            MOUNTS[row.setup](ckpt, cleanups)
        elif row.setup:
            SETUPS[row.setup](ckpt)
        before = tree_digest(ckpt)
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        argv = [a.replace("{ckpt}", str(ckpt)).replace("{busy_port}", str(busy.getsockname()[1])) for a in row.argv]
        if row.subprocess:
            result = torchfleet(*argv, timeout=200)
            code, err = result.returncode, result.stderr
        else:
            for name in _CLUSTER_VARS:
                monkeypatch.delenv(name, raising=False)
            for name, value in row.env.items():
                monkeypatch.setenv(name, value)
            code, err = _in_process(argv, capsys)
        assert code == 2, err
        assert "Traceback" not in err
        lines = err.strip().splitlines()
        assert len(lines) == 1, lines
        assert row.sentence in lines[0], lines[0]
        assert tree_digest(ckpt) == before, "an existing checkpoint changed"
    finally:
        busy.close()
        for args in reversed(cleanups):
            subprocess.run(args, capture_output=True)


# -- the config and the Python API: UsageError, one sentence -----------------------------
def _fleet_and_model():
    fleet = Fleet(strategy="serial")
    net = torch.nn.Linear(3, 2)
    fleet.setup(net, torch.optim.AdamW(net.parameters()))
    return fleet


def _closed_port():
    port = free_port()
    wait_for_master("127.0.0.1", port, wait=1)


API = {
    "config-unknown-optimizer": (
        lambda ckpt: TrainConfig(optimizer="lbfgs"),
        "unknown optimizer 'lbfgs'; choose one of sgd, adamw",
    ),
    "config-unknown-data": (lambda ckpt: TrainConfig(data="imagenet"), "unknown data set 'imagenet'"),
    "config-unknown-precision": (
        lambda ckpt: TrainConfig(precision="fp8"),
        "unknown precision 'fp8'; choose one of fp32, bf16, fp16",
    ),
    "config-port-zero": (lambda ckpt: LaunchConfig(master_port=0), "--master-port 0 is not a TCP port; use 1 to 65535"),
    "api-unknown-strategy": (lambda ckpt: Fleet(strategy="warp"), "unknown strategy 'warp'"),
    "api-zero-accumulation": (lambda ckpt: Fleet(grad_accum=0), "grad_accum 0 must be at least 1"),
    "api-unknown-option": (
        lambda ckpt: Fleet(strategy="serial", pp=2),
        "option 'pp' does not apply to strategy 'serial'",
    ),
    "api-fp16-on-cpu": (lambda ckpt: Fleet(precision="fp16"), "precision fp16 needs a CUDA device"),
    "api-unknown-reduction": (lambda ckpt: Fleet().all_reduce(1.0, op="median"), "unknown reduction 'median'"),
    "api-uneven-global-batch": (
        lambda ckpt: GlobalBatchSampler(100, 30, rank=0, world_size=4),
        "batch size 30 does not split evenly among 4 processes; use a multiple of 4 such as 28 or 32",
    ),
    "api-rank-out-of-range": (
        lambda ckpt: DistEnv.detect({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}),
        "RANK=3 is out of range for WORLD_SIZE=2",
    ),
    "api-missing-checkpoint": (lambda ckpt: _fleet_and_model().load(ckpt / "step-99999999"), "does not exist"),
    "api-checkpoint-of-another-model": (
        lambda ckpt: _fleet_and_model().load(next(ckpt.glob("step-*"))),
        "holds a different model",
    ),
    "api-unreachable-master": (lambda ckpt: _closed_port(), "cannot reach the master at 127.0.0.1:"),
    "api-dataloader-for-dataset": (
        lambda ckpt: Fleet().dataloader(DataLoader(synthetic(16), batch_size=32), 32),
        "fleet.dataloader takes a Dataset, not a DataLoader",
    ),
}


@pytest.mark.parametrize("name", sorted(API))
def test_api_row(name, good_checkpoint, tmp_path):
    ckpt = shutil.copytree(good_checkpoint, tmp_path / "ckpt")
    before = tree_digest(ckpt)
    call, sentence = API[name]
    with pytest.raises(UsageError) as info:
        call(ckpt)
    message = str(info.value)
    assert sentence in message and "\n" not in message
    assert tree_digest(ckpt) == before


def test_docs_table_lists_every_tested_row_and_nothing_else():
    text = (ROOT / "docs" / "reference" / "errors.md").read_text()
    named = set(re.findall(r"`(test_\w+\.py)::([^`]+)`", text))
    ours = {("test_errors.py", r.id) for r in ROWS} | {("test_errors.py", n) for n in API}
    cli_rows = {("test_cli.py", " ".join(args)) for args, _ in BAD}
    assert {n for n in named if n[0] in ("test_errors.py", "test_cli.py")} == ours | cli_rows
    # Rows proved elsewhere name a test function, or a parameter id, of that file.
    for file, name in named - ours - cli_rows:
        source = next((ROOT / "tests").rglob(file)).read_text()  # the file is in the folder of what it tests
        assert f"def {name}(" in source or (file == "test_outputs.py" and name in test_outputs.IDS), (file, name)
    assert len(named) >= 30
