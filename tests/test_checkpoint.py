"""Checkpoints: bit-identical resume, sharded saves read by another process count, kill -9 mid-save."""

import random
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, clean_env
from torchfleet import Fleet, UsageError, checkpoint, launch
from torchfleet.strategies import STRATEGY_NAMES
from torchfleet.testing import dropout_mlp, resume_job

SAVE_LOOP = str(ROOT / "tests" / "scripts" / "save_loop.py")


def _registered(strategy: str) -> None:
    if strategy not in STRATEGY_NAMES:
        pytest.skip(f"{strategy} strategy not registered on this branch")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["serial", "ddp", "fsdp"])
def test_stopped_and_resumed_equals_straight_bit_for_bit(strategy, tmp_path):
    """fp32, file and DCP checkpoints; the resumed half starts from other weights and RNG."""
    _registered(strategy)
    if strategy == "serial":
        results = resume_job("serial", str(tmp_path))
    else:
        results = launch(resume_job, nprocs=2, args=(strategy, str(tmp_path)))[0]
    for layout, (straight, resumed) in zip(("full", "sharded"), results, strict=True):
        assert torch.equal(straight, resumed), f"{layout}: max difference {(straight - resumed).abs().max():.3g}"
    if strategy == "serial":
        return
    # The sharded checkpoint of 2 processes loads into 1 and holds the same weights as the file one.
    fleet = Fleet(strategy="serial")
    torch.manual_seed(1)
    net = dropout_mlp()
    fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    before = [p.detach().clone() for p in net.parameters()]
    extra = fleet.load(tmp_path / "sharded" / "step-00000003")
    assert extra["step"] == 3
    full = torch.load(tmp_path / "full" / "step-00000003" / "state.pt", weights_only=True)["model"]
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, full[name]), name
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert fleet.strategy.optimizer.state  # AdamW's moments came back too


@pytest.mark.timeout(240)
def test_kill_9_at_random_moments_of_saving_leaves_the_newest_complete_one_loadable(tmp_path):
    rng = random.Random(6)
    fleet = Fleet(strategy="serial")
    net = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    first, interrupted = 1, 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, SAVE_LOOP, str(tmp_path), str(first)],
                                stdout=subprocess.PIPE, text=True, env=clean_env())
        assert proc.stdout.readline().startswith("saved")  # one complete save, then a kill at random
        subprocess.run(["sleep", f"{rng.uniform(0.0, 0.8):.3f}"])
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        interrupted += any(p.name.endswith((".partial", ".old")) for p in tmp_path.iterdir())
        found = checkpoint.list_checkpoints(tmp_path)
        assert found, "a kill left no loadable checkpoint"
        for path in found:
            checkpoint.verify(path)  # every published checkpoint is whole
        extra = fleet.load(found[-1])
        assert all(torch.all(p == extra["step"]) for p in net.parameters())
        first = extra["step"] + 1
    print(f"{interrupted} of 3 kills landed inside a save")


def test_damaged_files_are_named_and_fallback_steps_back(tmp_path):
    fleet = Fleet(strategy="serial")
    net = torch.nn.Linear(4, 2)
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for step in (1, 2):
        fleet.save(checkpoint.step_path(tmp_path, step), step=step)
    state = tmp_path / "step-00000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])  # truncated
    with pytest.raises(UsageError, match=r"step-00000002/state\.pt' is corrupt or truncated"):
        checkpoint.newest_good(fleet, tmp_path)
    path, manifest = checkpoint.newest_good(fleet, tmp_path, fallback=True)
    assert path.name == "step-00000001" and manifest["step"] == 1
