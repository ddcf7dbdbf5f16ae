"""Coming back after a preemption: `train --resume auto`, and a real Slurm job that requeues itself.

`--resume auto` starts from the beginning when --checkpoint-dir holds no checkpoint and
continues from the newest when it does, so a job started again with the same command
(requeued by Slurm, a pod restarted by Kubernetes) goes on where it stopped. On the
real one-node Slurm (tests/slurm_cluster.py) two `torchfleet slurm train --requeue` jobs
of 2 tasks, side by side, get SIGUSR1 (as `#SBATCH --signal=USR1@120` sends it before
the time limit) and SIGTERM mid-run, save, requeue themselves and train to the end;
their weights equal a serial run's of the same global batch.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import slurm_cluster
from helpers import clean_env, run, torchfleet
from torchfleet.cli import build_parser
from torchfleet.train.config import TrainConfig
from torchfleet.train.loop import train

JOB = [
    "--model",
    "mlp",
    "--data",
    "synthetic",
    "--synthetic-size",
    "512",
    "--batch-size",
    "32",
    "--no-progress",
    "--hang-timeout",
    "0",
]  # 16 steps an epoch


def _straight(path: Path, steps: int) -> None:
    """The uninterrupted serial run of JOB to `steps`, its weights in `path` (in this process)."""
    train(
        TrainConfig(
            strategy="serial",
            model="mlp",
            data="synthetic",
            synthetic_size=512,
            batch_size=32,
            progress=False,
            hang_timeout=0,
            max_steps=steps,
            save_model=str(path),
        ),
        "serial",
    )


def _max_difference(a: Path, b: Path) -> float:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert first.keys() == second.keys()
    return max((first[k].float() - second[k].float()).abs().max().item() for k in first)


@pytest.mark.timeout(300)  # five runs: 103 s of 120 in CI (30 Nov)
def test_resume_auto_starts_fresh_when_empty_and_continues_when_a_checkpoint_is_there(tmp_path):
    ck = tmp_path / "ck"
    args = [
        "train",
        "--strategy",
        "serial",
        *JOB,
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "3",
        "--resume",
        "auto",
    ]
    first = torchfleet(*args, "--max-steps", "6")
    assert first.returncode == 0, first.stderr
    assert f"note: no checkpoint in {ck}; starting from the beginning" in first.stdout, first.stdout
    assert "resumed from" not in first.stdout
    # The same command again, further: it continues from step 6 instead of starting over.
    second = torchfleet(
        *args,
        "--max-steps",
        "12",
        "--save-model",
        str(tmp_path / "resumed.pt"),
        "--json-out",
        str(tmp_path / "second.json"),
    )
    assert second.returncode == 0, second.stderr
    assert f"resumed from {ck / 'step-00000006'} at step 6" in second.stdout, second.stdout
    _straight(tmp_path / "straight.pt", 12)
    difference = _max_difference(tmp_path / "resumed.pt", tmp_path / "straight.pt")
    print(f"--resume auto: max weight difference {difference:.3g}")
    assert difference < 1e-5
    # Once more, with the run already at its last step: nothing to train, and the summary gives the
    # checkpoint's final loss and no rate (it printed "final loss nan" and "samples/s 0" before).
    third = torchfleet(*args, "--max-steps", "12", "--json-out", str(tmp_path / "third.json"))
    assert third.returncode == 0, third.stderr
    assert f"resumed from {ck / 'step-00000012'} at step 12" in third.stdout, third.stdout
    assert "nothing is left to train" in third.stdout and "nan" not in third.stdout, third.stdout
    before, after = (json.loads((tmp_path / f"{run}.json").read_text()) for run in ("second", "third"))
    assert after["steps"] == 12 and after["final_loss"] == before["final_loss"]
    assert "samples_per_s" in before and "samples_per_s" not in after and "samples/s" not in third.stdout


def test_plain_resume_and_auto_parse_apart():
    parser = build_parser()
    assert parser.parse_args(["train", "--resume"]).resume is True
    assert parser.parse_args(["train", "--resume", "auto"]).resume == "auto"
    assert parser.parse_args(["train"]).resume is False
    assert parser.parse_args(["train", "--resume", "--epochs", "2"]).resume is True


def _job_fields(cluster, job_id: str) -> dict[str, str]:
    shown = cluster.command("scontrol", "show", "job", job_id).stdout
    return dict(f.split("=", 1) for f in shown.split() if "=" in f)


def _submit(cluster, folder: Path, sig: signal.Signals) -> tuple[str, Path, Path]:
    """A `slurm train --requeue` job of 2 tasks submitted from `folder`: its id, its output file and the marker
    its rank 0 writes when it sleeps 20 s in step 6 on its first run (once=): the signal is sent then, and
    the two tasks agree to leave at their next loss read, step 10 (--log-every 10). The sleep outlasts the
    second job's submission, which comes between the first job's marker and its signal: 8 s at a load of 5,
    where a 1 s sleep let the first job finish all 20 steps before its signal ('Invalid job id')."""
    folder.mkdir()
    marker = folder / "fired"
    env = clean_env(**cluster.env_extra, TORCHFLEET_FAULT=f"sleep:rank=0:step=6:seconds=20:once={marker}")
    submitted = run(
        [
            sys.executable,
            "-m",
            "torchfleet",
            "slurm",
            "train",
            "--requeue",
            "--ntasks-per-node",
            "2",
            "--out",
            str(folder / "train.sbatch"),
            "--submit",
            "--",
            *JOB,
            "--checkpoint-dir",
            "ck",
            "--max-steps",
            "20",
            "--save-model",
            "final.pt",
        ],
        env=env,
        cwd=folder,
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "saving on SIGUSR1 (120 s before the time limit) or SIGTERM and requeueing itself" in submitted.stdout
    (job_id,) = re.findall(r"Submitted batch job (\d+)", submitted.stdout)
    return job_id, folder / f"torchfleet-train-{job_id}.out", marker


def _read(log: Path) -> str:
    return log.read_text() if log.exists() else "(no output file)"


@pytest.mark.waits
@pytest.mark.timeout(480)
def test_requeue_jobs_on_a_real_slurm_save_on_the_signal_requeue_themselves_and_finish(tmp_path):
    """Two jobs side by side on the one node (the test cluster lets two jobs share its CPUs), so that their
    waits overlap: one gets USR1 as `#SBATCH --signal=USR1@120` sends it before the time limit, the other
    TERM as `scancel --signal=TERM` (and a preemption) sends it to the tasks."""
    signals = (signal.SIGUSR1, signal.SIGTERM)
    with slurm_cluster.running() as cluster:
        jobs = {sig: _submit(cluster, tmp_path / sig.name, sig) for sig in signals}
        sent, requeued, held = {}, {}, {}
        for sig, (job_id, log, marker) in jobs.items():
            deadline = time.monotonic() + 150
            while not marker.exists():
                assert time.monotonic() < deadline, _read(log) + cluster.logs()
                time.sleep(0.05)
            sent[sig] = time.monotonic()
            # To every task, not the batch shell: what `#SBATCH --signal=USR1@120` does before the time limit.
            signalled = cluster.command("scancel", f"--signal={sig.name[3:]}", job_id)
            assert signalled.returncode == 0, (
                signalled.stderr + _read(log) + cluster.logs() + cluster.command("scontrol", "show", "job").stdout
            )
        for sig, (job_id, log, _) in jobs.items():
            while _job_fields(cluster, job_id).get("Restarts", "0") == "0":
                assert time.monotonic() < sent[sig] + 90, _read(log) + cluster.logs()
                time.sleep(0.1)
            requeued[sig] = time.monotonic() - sent[sig]
            fields = _job_fields(cluster, job_id)
            # Slurm holds a requeued job until EligibleTime, a job credential's lifetime after the requeue
            # (AuthInfo cred_expire: 120 s by default, 20 s in the test cluster). Not moved up: a job started
            # sooner is killed as "Job credential revoked" (seen with scontrol update StartTime=now). The
            # requeue itself was the job's own.
            assert fields["JobState"] in ("PENDING", "REQUEUED", "COMPLETING", "RUNNING"), fields
            held[sig] = fields.get("EligibleTime")
        _straight(tmp_path / "straight.pt", 20)  # the reference trains meanwhile
        finished = {}
        for sig, (job_id, log, _) in jobs.items():
            state, exit_code = cluster.wait(job_id, timeout=200)
            finished[sig] = time.monotonic() - sent[sig]
            assert (state, exit_code) == ("COMPLETED", "0:0"), _read(log) + cluster.logs()
    for sig, (job_id, log, _) in jobs.items():
        print(
            f"\nslurm --requeue, {sig.name}: signal to requeued {requeued[sig]:.1f} s (EligibleTime was"
            f" {held[sig]}), signal to finished {finished[sig]:.1f} s"
        )
        text = _read(log)
        assert (
            f"torchfleet: preempted by {sig.name} at step 10, checkpoint saved to ck/step-00000010, resume"
            f" with --resume; requeueing job {job_id}" in text
        ), text
        assert text.count(f"torchfleet: job {job_id} starts") == 2, text
        assert f"torchfleet: job {job_id} starts (requeued 1 time(s) so far)" in text, text
        assert "resumed from ck/step-00000010 at step 10" in text, text
        assert (log.parent / "ck" / "step-00000010").is_dir()
        difference = _max_difference(log.parent / "final.pt", tmp_path / "straight.pt")
        print(f"slurm --requeue, {sig.name}: max weight difference from an uninterrupted serial run {difference:.3g}")
        assert difference < 1e-5
