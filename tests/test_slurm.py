"""`torchfleet slurm`: the batch script it writes, and a real Slurm running it.

The cluster is Debian's slurm-wlm with munge, started on this machine by
`slurm_cluster.running()`; a job of 2 srun tasks trains examples/train_digits.py
and its weights must equal a serial run of the same global batch.
"""

from __future__ import annotations

import re
import sys

import pytest

import reference
import slurm_cluster
from conftest import EXAMPLES, ROOT, clean_env, run
from torchfleet.cli import main

SCRIPT = str(EXAMPLES / "train_digits.py")


def test_batch_script_for_two_gpu_nodes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "job.sbatch"
    assert main(["slurm", SCRIPT, "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu",
                 "--time", "2:00:00", "--out", str(out), "--", "--epochs", "3"]) == 0
    stdout = capsys.readouterr().out
    assert f"wrote {out}: 8 processes (2 x 4)" in stdout
    assert f"sbatch {out}" in stdout
    text = out.read_text()
    assert text.startswith("#!/bin/bash\n")
    directives = re.findall(r"^#SBATCH (\S+)$", text, flags=re.M)
    assert directives == ["--job-name=torchfleet-train_digits", "--nodes=2",
                          "--ntasks-per-node=4", "--gpus-per-node=4", "--partition=gpu",
                          "--time=2:00:00", f"--chdir={ROOT}", "--output=%x-%j.out"]
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert srun == f"srun --kill-on-bad-exit=1 {sys.executable} -u {SCRIPT} --epochs 3"
    assert 'OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"' in text


def test_batch_script_to_stdout_for_a_cpu_job(capsys):
    assert main(["slurm", "--out", "-", SCRIPT]) == 0
    out = capsys.readouterr().out
    assert "--ntasks-per-node=1" in out and "gpus" not in out
    assert "OMP_NUM_THREADS" not in out  # one task per node: all its cores


BAD = [
    (["--nodes", "0"], "--nodes 0 must be at least 1"),
    (["--gpus-per-node", "2", "--ntasks-per-node", "3"],
     "--ntasks-per-node 3 is more than --gpus-per-node 2"),
    (["--time", "two hours"], "--time 'two hours' is not a Slurm time limit"),
    (["--partition", "gpu a"], "--partition 'gpu a' is not a partition name"),
    (["--out", "-", "--submit"], "--submit needs it in a file"),
]


@pytest.mark.parametrize("flags,sentence", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input(flags, sentence, capsys):
    assert main(["slurm", SCRIPT, *flags]) == 2
    err = capsys.readouterr().err
    assert sentence in err and len(err.strip().splitlines()) == 1


def test_submit_without_sbatch_says_where_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["slurm", SCRIPT, "--out", str(tmp_path / "j.sbatch"), "--submit"]) == 2
    assert "sbatch is not on PATH; run --submit on a Slurm login node" in capsys.readouterr().err
    assert (tmp_path / "j.sbatch").is_file()  # written all the same


@pytest.mark.timeout(300)
def test_two_tasks_on_a_real_slurm_train_like_one_process(tmp_path):
    with slurm_cluster.running() as cluster:
        job_file = tmp_path / "digits.sbatch"
        # Run from tmp_path: the job's working folder (--chdir) and its output go there.
        submitted = run([sys.executable, "-m", "torchfleet", "slurm", SCRIPT, "--ntasks-per-node",
                         "2", "--out", str(job_file), "--submit", "--", "--epochs", "1", "--out",
                         str(tmp_path / "slurm.pt")], env=clean_env(**cluster.env_extra),
                        cwd=tmp_path)
        assert submitted.returncode == 0, submitted.stderr
        (job_id,) = re.findall(r"Submitted batch job (\d+)", submitted.stdout)
        reference.serial_weights()  # the single-process reference trains meanwhile
        state, exit_code = cluster.wait(job_id, timeout=240)
        log = (tmp_path / f"torchfleet-train_digits-{job_id}.out")
        output = log.read_text() if log.exists() else "(no output file)"
        assert (state, exit_code) == ("COMPLETED", "0:0"), output + cluster.logs()
    assert output.count("epoch 1:") == 1, output  # two tasks, one printing rank
    assert reference.max_difference(tmp_path / "slurm.pt") < 1e-5
