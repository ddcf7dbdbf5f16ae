"""Coming back after a preemption: `train --resume auto`, and a real Slurm job that requeues itself.

`--resume auto` starts from the beginning when --checkpoint-dir holds no checkpoint and
continues from the newest when it does, so a job started again with the same command
(requeued by Slurm, a pod restarted by Kubernetes) goes on where it stopped. On the
real one-node Slurm (tests/slurm_cluster.py) a `torchfleet slurm train --requeue` job
of 2 tasks gets SIGUSR1 mid-run (as `#SBATCH --signal=USR1@120` sends it before the
time limit), saves, requeues itself and trains to the end; its weights equal a serial
run's of the same global batch.
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
from conftest import clean_env, run, torchfleet
from torchfleet.cli import build_parser
from torchfleet.train.config import TrainConfig
from torchfleet.train.loop import train

JOB = ["--model", "mlp", "--data", "synthetic", "--synthetic-size", "512", "--batch-size", "32",
       "--no-progress", "--hang-timeout", "0"]  # 16 steps an epoch


def _straight(path: Path, steps: int) -> None:
    """The uninterrupted serial run of JOB to `steps`, its weights in `path` (in this process)."""
    train(TrainConfig(strategy="serial", model="mlp", data="synthetic", synthetic_size=512, batch_size=32,
                      progress=False, hang_timeout=0, max_steps=steps, save_model=str(path)), "serial")


def _max_difference(a: Path, b: Path) -> float:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert first.keys() == second.keys()
    return max((first[k].float() - second[k].float()).abs().max().item() for k in first)


@pytest.mark.timeout(120)
def test_resume_auto_starts_fresh_when_empty_and_continues_when_a_checkpoint_is_there(tmp_path):
    ck = tmp_path / "ck"
    args = ["train", "--strategy", "serial", *JOB, "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
            "--resume", "auto"]
    first = torchfleet(*args, "--max-steps", "6")
    assert first.returncode == 0, first.stderr
    assert f"note: no checkpoint in {ck}; starting from the beginning" in first.stdout, first.stdout
    assert "resumed from" not in first.stdout
    # The same command again, further: it continues from step 6 instead of starting over.
    second = torchfleet(*args, "--max-steps", "12", "--save-model", str(tmp_path / "resumed.pt"),
                        "--json-out", str(tmp_path / "second.json"))
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


@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_a_requeue_job_on_a_real_slurm_saves_on_the_signal_requeues_itself_and_finishes(sig, tmp_path):
    """USR1 as `#SBATCH --signal=USR1@120` sends it before the time limit; TERM as `scancel --signal=TERM`
    (and a preemption) sends it to the tasks."""
    marker = tmp_path / "fired"
    with slurm_cluster.running() as cluster:
        job_file = tmp_path / "train.sbatch"
        # Rank 0 sleeps 1 s in step 6 on the first run only (once=): the signal lands there, and the two
        # tasks agree to leave at their next loss read, step 10 (--log-every 10).
        env = clean_env(**cluster.env_extra, TORCHFLEET_FAULT=f"sleep:rank=0:step=6:seconds=1:once={marker}")
        submitted = run([sys.executable, "-m", "torchfleet", "slurm", "train", "--requeue", "--ntasks-per-node",
                         "2", "--out", str(job_file), "--submit", "--", *JOB, "--checkpoint-dir", "ck",
                         "--max-steps", "20", "--save-model", "final.pt"], env=env, cwd=tmp_path)
        assert submitted.returncode == 0, submitted.stderr
        assert "saving on SIGUSR1 (120 s before the time limit) or SIGTERM and requeueing itself" in submitted.stdout
        (job_id,) = re.findall(r"Submitted batch job (\d+)", submitted.stdout)
        log = tmp_path / f"torchfleet-train-{job_id}.out"

        def output() -> str:
            return log.read_text() if log.exists() else "(no output file)"

        deadline = time.monotonic() + 150
        while not marker.exists():
            assert time.monotonic() < deadline, output() + cluster.logs()
            time.sleep(0.05)
        sent = time.monotonic()
        # To every task, not the batch shell: what `#SBATCH --signal=USR1@120` does before the time limit.
        signalled = cluster.command("scancel", f"--signal={sig.name[3:]}", job_id)
        assert signalled.returncode == 0, signalled.stderr
        while _job_fields(cluster, job_id).get("Restarts", "0") == "0":
            assert time.monotonic() < sent + 90, output() + cluster.logs()
            time.sleep(0.1)
        requeued = time.monotonic() - sent
        fields = _job_fields(cluster, job_id)
        # Slurm holds a requeued job until EligibleTime, a job credential's lifetime after the requeue
        # (AuthInfo cred_expire: 120 s by default, 20 s in the test cluster). Not moved up: a job started
        # sooner is killed as "Job credential revoked" (seen with scontrol update StartTime=now). The
        # requeue itself was the job's own.
        assert fields["JobState"] in ("PENDING", "REQUEUED", "COMPLETING"), fields
        held = fields.get("EligibleTime")
        _straight(tmp_path / "straight.pt", 20)  # the reference trains meanwhile
        state, exit_code = cluster.wait(job_id, timeout=200)
        round_trip = time.monotonic() - sent
        text = output()
        assert (state, exit_code) == ("COMPLETED", "0:0"), text + cluster.logs()
    print(f"\nslurm --requeue, {sig.name}: signal to requeued {requeued:.1f} s (EligibleTime was {held}),"
          f" signal to finished {round_trip:.1f} s")
    saved = tmp_path / "ck" / "step-00000010"
    assert f"torchfleet: preempted by {sig.name} at step 10, checkpoint saved to ck/step-00000010, resume with" \
           f" --resume; requeueing job {job_id}" in text, text
    assert text.count(f"torchfleet: job {job_id} starts") == 2, text
    assert f"torchfleet: job {job_id} starts (requeued 1 time(s) so far)" in text, text
    assert "resumed from ck/step-00000010 at step 10" in text, text
    assert saved.is_dir()
    difference = _max_difference(tmp_path / "final.pt", tmp_path / "straight.pt")
    print(f"slurm --requeue, {sig.name}: max weight difference from an uninterrupted serial run {difference:.3g}")
    assert difference < 1e-5
