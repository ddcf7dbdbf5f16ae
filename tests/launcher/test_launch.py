"""Launching real processes through torchrun's agent: same weights three ways, failures summarised."""

import sys
import time

import pytest
import torch

from helpers import EXAMPLES, ROOT, run, torchfleet
from torchfleet import UsageError, launch
from torchfleet.launcher.agent import LaunchError

SCRIPT = str(EXAMPLES / "train_digits.py")
CRASH = str(ROOT / "tests" / "scripts" / "crash.py")


def _weights(path):
    return torch.cat([t.flatten() for t in torch.load(path, weights_only=True).values()])


@pytest.mark.timeout(240)
def test_same_script_python_torchfleet_torchrun(tmp_path):
    single = run([sys.executable, SCRIPT, "--strategy", "serial", "--out", str(tmp_path / "python.pt")])
    assert single.returncode == 0, single.stderr
    fleet = torchfleet("run", "-n", "2", SCRIPT, "--out", str(tmp_path / "fleet.pt"))
    assert fleet.returncode == 0, fleet.stderr
    # Plain torchrun, as `python -m torch.distributed.run` (what the torchrun script runs).
    plain = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            SCRIPT,
            "--out",
            str(tmp_path / "torchrun.pt"),
        ]
    )
    assert plain.returncode == 0, plain.stderr
    reference = _weights(tmp_path / "python.pt")
    for name in ("fleet.pt", "torchrun.pt"):
        assert (_weights(tmp_path / name) - reference).abs().max().item() < 1e-5, name
    # Only the main rank prints: one line per epoch, not one per rank.
    assert fleet.stdout.count("epoch 1:") == 1


@pytest.mark.timeout(120)
def test_crashed_rank_is_summarised_once():
    start = time.monotonic()
    result = torchfleet("run", "-n", "2", CRASH, "raise")
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    err = result.stderr
    assert "rank 1 (local rank 1 on" in err and "failed first: exit code 1" in err
    assert "ValueError: boom on purpose" in err
    assert err.count("Traceback (most recent call last)") == 1  # shown once, by the summary
    assert "crash.py" in err  # the traceback points at the user's line
    assert elapsed < 60  # rank 0 was stopped, not waited out


@pytest.mark.timeout(120)
def test_killed_rank_names_the_signal():
    result = torchfleet("run", "-n", "2", CRASH, "kill")
    assert result.returncode == 128 + 9
    assert "rank 1" in result.stderr and "killed by SIGKILL" in result.stderr


@pytest.mark.timeout(120)
def test_exit_code_of_failed_rank_is_passed_on():
    result = torchfleet("run", "-n", "2", CRASH, "exit")
    assert result.returncode == 3
    assert "exit code 3" in result.stderr


def _square(x):
    import os

    return int(os.environ["RANK"]) * x


def _fail_on_rank_one():
    import os

    if os.environ["RANK"] == "1":
        raise RuntimeError("rank one is unhappy")


def _fail_then_fail_cleaning_up():
    import os

    if os.environ["RANK"] == "1":
        try:
            raise ValueError("the cause")
        finally:
            raise RuntimeError("the cleanup failed too")  # noqa: B012 - on purpose


@pytest.mark.timeout(120)
def test_python_launch_returns_each_ranks_result():
    assert launch(_square, nprocs=2, args=(7,)) == [0, 7]


def _surroundings(name: str) -> tuple:
    import os

    from torchfleet.launcher import forked

    return (
        os.environ.get(name),
        os.environ["OMP_NUM_THREADS"],
        torch.get_num_threads(),
        os.getcwd(),
        os.getpid() != forked.SERVER_PID,
    )


@pytest.mark.timeout(180)
def test_a_launchs_workers_see_the_callers_environment_as_it_is_at_that_launch(tmp_path, monkeypatch):
    # Workers fork from a server that started with the first launch (launcher/forked.py); the second launch's
    # workers must still see the variable, directory and thread count the caller has now, as spawned ones would.
    name = "TORCHFLEET_TEST_SURROUNDINGS"
    monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    first = launch(_surroundings, nprocs=2, args=(name,))
    assert [r[0] for r in first] == [None, None]
    monkeypatch.setenv(name, "set after the server started")
    monkeypatch.chdir(tmp_path)
    second = launch(_surroundings, nprocs=2, args=(name,))
    assert second == [("set after the server started", "1", 1, str(tmp_path), True)] * 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert [r[1:3] for r in launch(_surroundings, nprocs=2, args=(name,))] == [("2", 2)] * 2


def _tensors(n: int) -> dict:
    import os

    return {f"t{i}": torch.full((3,), float(i + int(os.environ["RANK"]))) for i in range(n)}


@pytest.mark.timeout(120)
def test_tensors_a_launch_returns_hold_no_file_descriptors():
    """torch's queue sends a tensor as shared memory, one open file descriptor per tensor for as long as it
    lives: a test suite that kept the weights its launches returned reached 1,878 and select() failed."""
    import os

    before = len(os.listdir("/proc/self/fd"))
    kept = launch(_tensors, nprocs=2, args=(300,))
    assert torch.equal(kept[1]["t299"], torch.full((3,), 300.0))
    assert len(os.listdir("/proc/self/fd")) - before < 20


@pytest.mark.timeout(120)
def test_python_launch_raises_with_the_summary():
    with pytest.raises(LaunchError) as info:
        launch(_fail_on_rank_one, nprocs=2)
    assert info.value.summary.first.rank == 1
    assert "RuntimeError: rank one is unhappy" in str(info.value)


@pytest.mark.timeout(120)
def test_a_failure_reports_its_first_cause_not_the_cleanup():
    with pytest.raises(LaunchError) as info:
        launch(_fail_then_fail_cleaning_up, nprocs=2)
    first = info.value.summary.first
    assert first.rank == 1
    assert first.error == ("ValueError: the cause (then, while handling it, RuntimeError: the cleanup failed too)")


def test_python_launch_rejects_zero_processes():
    with pytest.raises(UsageError, match="nprocs 0"):
        launch(_square, nprocs=0)


@pytest.mark.timeout(120)
def test_rendezvous_events_name_the_handler_method_as_torch_does(monkeypatch):
    """torchfleet reads the method names of torch's rendezvous event records off the frame instead of
    torch's inspect.stack() (launcher/rendezvous.py): the records still name the method that made them."""
    import inspect
    import os

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from torchfleet.launcher import rendezvous

    assert dynamic_rendezvous.get_method_name is rendezvous._method_name

    def record():  # as torch's handlers call it: from their _record, for _record's caller
        return dynamic_rendezvous.get_method_name(), inspect.stack()[1].function  # [0] is record

    def next_round():
        return record()

    assert next_round() == ("next_round", "next_round")
    names: list[str] = []
    monkeypatch.setattr(dynamic_rendezvous, "construct_and_record_rdzv_event", lambda **kw: names.append(kw["name"]))
    pids = launch(os.getpid, nprocs=2)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    methods = {name.split(".")[-1] for name in names}
    assert "next_rendezvous" in methods, names
    assert "_record" not in methods and "no_method_name" not in methods, names
