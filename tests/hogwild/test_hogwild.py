"""hogwild: workers really share one model, training converges like serial, nothing is left behind."""

import csv
import gc
import multiprocessing.resource_tracker
import os
import time

import pytest
import torch
from torch import nn

from torchfleet import UsageError, hogwild
from torchfleet.hogwild.worker import worker_info
from torchfleet.train.config import TrainConfig
from torchfleet.train.loop import train

ACCURACY_POINTS = 0.02


def exchange(model: nn.Module) -> list[float]:
    """Each worker writes its own row, then waits to see every other worker's row."""
    info = worker_info()
    with torch.no_grad():
        model.weight[info.rank] += info.rank + 1
    want = [float(r + 1) for r in range(info.world_size)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = model.weight[:, 0].tolist()
        if seen == want:
            break
        time.sleep(0.01)
    return seen


def _ours() -> tuple[set[str], int]:
    """Shared-memory segments this process created, and its open descriptors.

    Segments are told apart by the creator's pid in their names (torch_PID_...):
    on a machine where other programs use /dev/shm too, a plain count would
    measure them. Workers create no segments (they map the parent's), and the
    run needs no named semaphore (results come back through pipes).
    """
    mine = {name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{os.getpid()}_")}
    return mine, len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def warm():
    # Process-wide helpers that live as long as this process, started on first
    # use by any torch.multiprocessing program: multiprocessing's resource
    # tracker (one pipe) and the connection to torch_shm_manager (one socket).
    # Start them before counting, so the counts compare one run with another.
    multiprocessing.resource_tracker.ensure_running()
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    probe = torch.zeros(4).share_memory_()
    del probe
    gc.collect()
    torch.multiprocessing.set_sharing_strategy(previous)


@pytest.mark.timeout(180)
def test_a_workers_update_is_seen_by_the_others_and_the_parent(warm):
    model = nn.Linear(1, 2, bias=False)
    nn.init.zeros_(model.weight)
    before = _ours()
    seen = hogwild.run(exchange, model, nprocs=2, sharing_strategy="file_system")
    assert seen == [[1.0, 2.0], [1.0, 2.0]]  # worker 0 saw worker 1's write, and back
    assert model.weight[:, 0].tolist() == [1.0, 2.0]  # and so does the parent
    assert not model.weight.is_shared()  # back in private memory after the run
    assert _ours() == before  # no segment left in /dev/shm, no descriptor left open


@pytest.mark.timeout(240)
def test_converges_like_serial_and_leaves_nothing_behind(warm):
    # 10 epochs: near convergence, where the workers' races (by design) move accuracy least.
    common = dict(model="mlp", epochs=10, progress=False)
    before = _ours()
    shared = train(TrainConfig(strategy="hogwild", **common), "hogwild", nproc=2)
    assert _ours() == before
    serial = train(TrainConfig(strategy="serial", **common), "serial")
    assert shared["world_size"] == 2 and shared["strategy"] == "hogwild"
    # The same samples seen: each worker stepped on its half of every global batch.
    assert shared["steps"] == serial["steps"] == 10 * (1438 // 64)
    assert shared["val_accuracy"] > 0.9  # the parent evaluates the workers' shared weights
    assert shared["val_accuracy"] >= serial["val_accuracy"] - ACCURACY_POINTS, (shared, serial)


@pytest.mark.timeout(180)
def test_its_workers_run_the_loop_every_strategy_runs_and_log_each_workers_figures(warm, tmp_path):
    """How the workers start is hogwild's one difference: each runs train's loop (train/loop.py's run_worker), so
    the run's services come with it. The workers' Gloo group carries the figures, never a gradient: worker 0
    writes every worker's row of each logged step, and the losses it logs are the workers' mean."""
    metrics = tmp_path / "m.csv"
    job = dict(model="mlp", data="synthetic", synthetic_size=256, batch_size=32, epochs=1, log_every=3)
    result = train(
        TrainConfig(strategy="hogwild", progress=False, hang_timeout=0, metrics_out=str(metrics), **job),
        "hogwild",
        nproc=2,
    )
    assert (result["strategy"], result["world_size"], result["steps"]) == ("hogwild", 2, 8)
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    ranks = [(int(r["step"]), int(r["rank"])) for r in rows if r["kind"] == "rank"]
    assert ranks == [(s, k) for s in (3, 6, 8) for k in (0, 1)]
    assert all(float(r["step_s"]) >= float(r["compute_s"]) > 0 for r in rows if r["kind"] == "rank")
    assert [(r["kind"], int(r["step"])) for r in rows if r["kind"] != "rank"] == [
        ("train", 3),
        ("train", 6),
        ("train", 8),
        ("val", 8),
    ]
    (val,) = [r for r in rows if r["kind"] == "val"]
    assert float(val["val_accuracy"]) == result["val_accuracy"]  # both workers' halves, summed over the group


@pytest.mark.timeout(180)
def test_a_workers_usage_error_reaches_the_parent_as_one(warm):
    cfg = TrainConfig(strategy="hogwild", model="mlp", epochs=1, grad_accum=3, progress=False)
    with pytest.raises(UsageError, match="does not split into 3 accumulation steps"):
        train(cfg, "hogwild", nproc=2)


def test_bad_options_fail_before_any_worker_starts(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(
        UsageError, match="unknown sharing strategy 'shm'; this platform offers file_descriptor, file_system"
    ):
        hogwild.run(exchange, model, nprocs=2, sharing_strategy="shm")
    assert not model.weight.is_shared()
    with pytest.raises(UsageError, match="no single state to checkpoint"):
        train(TrainConfig(strategy="hogwild", checkpoint_dir=str(tmp_path)), "hogwild", nproc=2)
    with pytest.raises(UsageError, match="option 'pp' does not apply to strategy 'hogwild'"):
        train(TrainConfig(strategy="hogwild", strategy_options={"pp": 2}), "hogwild", nproc=2)


def test_outside_a_worker_it_is_serial_and_says_so():
    import torchfleet

    fleet = torchfleet.Fleet(strategy="hogwild")
    assert fleet.strategy.data_coords() == (0, 1)
    assert fleet.notes == ["hogwild outside torchfleet.hogwild.run has one worker; running it as serial"]


@pytest.mark.timeout(180)
def test_train_from_the_command_line(tmp_path):
    from helpers import torchfleet as cli

    out = tmp_path / "result.json"
    result = cli("train", "--strategy", "hogwild", "-n", "2", "--model", "mlp", "--epochs", "1", "--json-out", str(out))
    assert result.returncode == 0, result.stderr
    import json

    figures = json.loads(out.read_text())
    assert figures["strategy"] == "hogwild" and figures["world_size"] == 2 and figures["steps"] == 22
    assert figures["val_accuracy"] > 0.5 and figures["samples_per_s"] > 0
    assert result.stdout.count("epoch 1: validation accuracy") == 1  # worker 0 speaks, once
    assert "validation accuracy" in result.stdout and "Traceback" not in result.stderr
