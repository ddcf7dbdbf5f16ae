"""Faults with real processes: a killed rank, a hung rank, a crashed rank, a non-finite loss.

Each fault is injected by the TORCHFLEET_FAULT test hook (src/torchfleet/train/faults.py).
"""

import time

import pytest
import torch

from helpers import clean_env, torchfleet

JOB = [
    "train",
    "--strategy",
    "ddp",
    "-n",
    "2",
    "--model",
    "mlp",
    "--data",
    "synthetic",
    "--synthetic-size",
    "512",
    "--batch-size",
    "32",
    "--epochs",
    "1",
    "--no-progress",
]  # 16 steps


def _final_model(directory):
    return torch.load(directory / "step-00000016" / "state.pt", weights_only=True)["model"]


@pytest.mark.timeout(300)
def test_sigkilled_rank_restarts_the_group_which_resumes_to_the_same_weights(tmp_path):
    marker = tmp_path / "fired"
    every = ["--checkpoint-every", "4"]
    killed = torchfleet(
        *JOB,
        *every,
        "--max-restarts",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "killed"),
        env=clean_env(TORCHFLEET_FAULT=f"kill:rank=1:step=6:once={marker}"),
        timeout=240,
    )
    assert killed.returncode == 0, killed.stderr
    assert marker.exists()  # it did fire, once
    assert "resumed from" in killed.stdout and "step-00000004 at step 4" in killed.stdout  # 2 steps redone <= 4
    straight = torchfleet(*JOB, *every, "--checkpoint-dir", str(tmp_path / "straight"), timeout=240)
    assert straight.returncode == 0, straight.stderr
    a, b = _final_model(tmp_path / "killed"), _final_model(tmp_path / "straight")
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.timeout(180)
def test_a_sleeping_rank_gets_one_verdict_and_a_non_zero_exit(tmp_path):
    result = torchfleet(*JOB, "--hang-timeout", "3", env=clean_env(TORCHFLEET_FAULT="sleep:rank=1:step=5"), timeout=150)
    assert result.returncode == 124, result.stderr
    err = result.stderr
    verdict = err.split("\n")[0]
    assert verdict.startswith("torchfleet: error: hang: rank 1 on "), err
    assert "has been in maybe_fire for" in verdict and "at faults.py:" in verdict and "(step 5)" in verdict
    assert "rank 0 waits in backward" in verdict  # DDP's gradient all-reduce waits for rank 1
    assert err.count("main thread:") == 2  # every rank's stack, once
    # from the user's side of the launch: not the forkserver's, multiprocessing's or runpy's frames
    assert "multiprocessing" not in err and "runpy" not in err, err
    assert err.count("has been in") == 1


@pytest.mark.timeout(180)
def test_a_crash_is_summarised_once_and_the_other_rank_stops_within_10_s(tmp_path):
    marker = tmp_path / "fired"
    result = torchfleet(*JOB, env=clean_env(TORCHFLEET_FAULT=f"raise:rank=1:step=3:once={marker}"), timeout=150)
    ended = time.time()
    crashed = float(marker.read_text())
    assert result.returncode == 1
    err = result.stderr
    assert "rank 1 (local rank 1 on " in err and "failed first: exit code 1" in err
    assert err.count("Traceback (most recent call last)") == 1
    assert "RuntimeError: fault injected by TORCHFLEET_FAULT on rank 1 at step 3" in err
    assert ended - crashed < 10, f"the job took {ended - crashed:.1f} s to stop after rank 1 crashed"


def test_a_non_finite_loss_stops_with_step_and_rank(tmp_path, capsys):
    from torchfleet import cli

    code = cli.main(
        [
            "train",
            "--strategy",
            "serial",
            "--model",
            "mlp",
            "--data",
            "synthetic",
            "--synthetic-size",
            "512",
            "--optimizer",
            "sgd",
            "--lr",
            "1e20",
            "--max-steps",
            "30",
            "--no-progress",
            "--hang-timeout",
            "0",
            "--checkpoint-dir",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert "the loss is nan at step 2 on rank 0; training stopped" in lines[0]
    assert not list(tmp_path.iterdir())  # nothing saved from a diverged run


def _report(rank, step, *frames):
    return {
        "rank": rank,
        "host": f"host-{rank}",
        "pid": 100 + rank,
        "step": step,
        "phase": "train",
        "stack": [("/home/me/train.py", 10, "<module>"), *frames],
    }


def test_verdict_names_the_straggler_and_groups_the_waiters():
    from torchfleet.worker.hang_watchdog import _TORCH_DIR, verdict

    collective = (f"{_TORCH_DIR}/distributed/distributed_c10d.py", 2800, "all_reduce")
    reports = {
        0: _report(0, 8, ("/home/me/train.py", 42, "sync"), collective),
        1: _report(1, 7, ("/home/me/data.py", 9, "read_shard")),
        2: _report(2, 8, ("/home/me/train.py", 42, "sync"), collective),
    }
    assert verdict(reports, 4, 61.2) == (
        "rank 1 on host-1 has been in read_shard for 61 s at data.py:9 (step 7);"
        " rank 3 did not answer in 10 s (stuck in native code holding the GIL, or frozen);"
        " ranks 0, 2 wait in all_reduce at train.py:42 (step 8)"
    )
    everyone_waits = {r: _report(r, 8, ("/home/me/train.py", 42, "sync"), collective) for r in range(2)}
    assert verdict(everyone_waits, 2, 30).startswith(
        "no rank has made progress for 30 s: all ranks wait in all_reduce at train.py:42 (step 8)"
    )


def test_a_malformed_fault_is_refused():
    from torchfleet import UsageError
    from torchfleet.train.faults import parse

    assert parse("kill:rank=1:step=7:once=/tmp/x").once == "/tmp/x"
    with pytest.raises(UsageError, match="is not a fault"):
        parse("explode:rank=1:step=7")


def _fail(why):
    if why == "cause":
        raise ValueError("the cause: rank 1's own bug")
    raise RuntimeError("[gloo/transport] Connection closed by peer [127.0.0.1]:29500")  # what its peer's exit leaves


def test_the_agent_adds_the_cause_its_poll_did_not_find(tmp_path):
    """torch's MultiprocessContext reports one failed rank per poll: the first it finds, not the first to
    fail. Two real workers both fail and record why; the agent is handed only the echo (rank 0, as its poll
    finds it once both have exited) and must add rank 1's own failure, which the summary then puts first."""
    from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from torchfleet.launcher import failures
    from torchfleet.launcher.agent import _Agent

    pcontext = start_processes(
        "both-fail",
        failures.Recorded(_fail),
        args={0: ("echo",), 1: ("cause",)},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
        start_method="spawn",
    )
    try:
        processes = pcontext._pc.processes
        for process in processes:
            process.join(timeout=60)
        assert [p.exitcode for p in processes] == [1, 1]
        found = {0: ProcessFailure(local_rank=0, pid=processes[0].pid, exitcode=1, error_file=pcontext.error_files[0])}
        agent = _Agent.__new__(_Agent)  # the method reads only the process context
        agent._pcontext = pcontext
        group = WorkerGroup.__new__(WorkerGroup)
        group.workers = [Worker(local_rank=r, global_rank=r) for r in (0, 1)]
        agent._add_the_other_failures(group, found)
        assert sorted(found) == [0, 1]
        summary = failures.summarize(ChildFailedError("both-fail", found))
        assert (summary.first.rank, summary.first.error) == (1, "ValueError: the cause: rank 1's own bug")
        assert [o.rank for o in summary.others] == [0]
    finally:
        pcontext.close()
