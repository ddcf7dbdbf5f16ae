"""Output paths are proven writable before any work: one sentence, exit 2, nothing lost."""

from __future__ import annotations

import json

import pytest

from helpers import forked_torchfleet, torchfleet
from torchfleet.errors import UsageError
from torchfleet.outputs import check_writable_file, write_text

SCRIPT = "print('hello')\n"
# Each output flag, with a path whose directory cannot be created (a file is in its way).
UNWRITABLE = [
    ("train --json-out", ["train", "--strategy", "serial", "--json-out", "{blocked}/result.json"], "--json-out"),
    (
        "train --checkpoint-dir",
        ["train", "--strategy", "serial", "--checkpoint-dir", "{blocked}/ckpt"],
        "--checkpoint-dir",
    ),
    (
        "train -n 2 --json-out",
        ["train", "--strategy", "ddp", "-n", "2", "--json-out", "{blocked}/result.json"],
        "--json-out",
    ),
    ("bench --out", ["bench", "--quick", "--out", "{blocked}/bench"], "--out"),
    ("slurm --out", ["slurm", "{script}", "--out", "{blocked}/job.sbatch"], "--out"),
    ("k8s --out", ["k8s", "{script}", "--out", "{blocked}/job.yaml"], "--out"),
    ("sagemaker --out", ["sagemaker", "{script}", "--out", "{blocked}/sm"], "--out"),
]
IDS = [name for name, _, _ in UNWRITABLE]


@pytest.fixture
def paths(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("in the way\n")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return {"blocked": str(blocked), "script": str(script)}


@pytest.mark.parametrize("name,args,flag", UNWRITABLE, ids=IDS)
def test_unwritable_output_is_refused_before_any_work(name, args, flag, paths, tmp_path):
    args = [a.format(**paths) for a in args]
    path = next(a for a in args if a.startswith(paths["blocked"]))
    result = forked_torchfleet(*args, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert flag in lines[0] and repr(path) in lines[0]
    assert result.stdout == ""  # nothing trained, planned or measured first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "job.py"]  # nothing left behind


def test_json_out_that_is_a_directory_is_refused(tmp_path):
    result = forked_torchfleet("train", "--strategy", "serial", "--json-out", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "is a directory; give a file name" in result.stderr and result.stdout == ""


@pytest.mark.timeout(300)
def test_missing_directories_are_created(tmp_path, paths):
    figures = tmp_path / "new" / "deeper" / "result.json"
    checkpoints = tmp_path / "also-new" / "ckpt"
    result = torchfleet(
        "train",
        "--strategy",
        "serial",
        "--model",
        "mlp",
        "--max-steps",
        "3",
        "--epochs",
        "1",
        "--json-out",
        str(figures),
        "--checkpoint-dir",
        str(checkpoints),
        "--no-progress",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(figures.read_text())["steps"] == 3
    assert [p.name for p in checkpoints.iterdir() if p.name.startswith("step-")] == ["step-00000003"]

    bench_out = tmp_path / "bench-new" / "run1"
    result = torchfleet(
        "bench", "--quick", "--strategies", "serial", "--rounds", "1", "--out", str(bench_out), timeout=240
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((bench_out / "results.json").read_text())["cells"][0]["status"] == "ok"

    sbatch = tmp_path / "jobs-new" / "job.sbatch"
    result = torchfleet("slurm", paths["script"], "--out", str(sbatch), timeout=60)
    assert result.returncode == 0, result.stderr
    assert sbatch.read_text().startswith("#!")


def test_a_failed_write_keeps_the_old_file_and_prints_the_text(tmp_path, capsys):
    target = tmp_path / "result.json"
    target.write_text("old\n")
    assert check_writable_file(target, "--json-out") == target  # an existing file is fine, and kept
    assert target.read_text() == "old\n"
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(UsageError, match=r"--json-out '.*a-file/r.json' could not be written"):
        write_text(blocked / "r.json", '{"val_accuracy": 0.97}\n', "--json-out")
    assert capsys.readouterr().out == '{"val_accuracy": 0.97}\n'  # the result is not lost
    write_text(target, "new\n", "--json-out")
    assert target.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "result.json"]
