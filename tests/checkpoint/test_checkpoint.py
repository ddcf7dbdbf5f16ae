"""Checkpoints: bit-identical resume, sharded saves read by another process count, kill -9 mid-save."""

import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import ROOT, clean_env
from torchfleet import Fleet, UsageError, checkpoint, launch
from torchfleet.strategies import registry
from torchfleet.testing.equivalence import dropout_mlp, resume_job

SAVE_LOOP = str(ROOT / "tests" / "scripts" / "save_loop.py")


def _registered(strategy: str) -> None:
    if registry.find(strategy) is None:
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
def test_kill_9_during_saves_leaves_the_newest_complete_one_loadable(tmp_path):
    """save_loop.py saves step after step (file and DCP layouts in turn) until a SIGKILL: from
    the save path's test hook, in the middle of a given step's save (every time), or at a random
    moment. Afterwards the checkpoint found is the newest that completed, whole and loadable."""
    rng = random.Random(6)
    fleet = Fleet(strategy="serial")
    net = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    first, inside = 1, 0
    for how, layout in (("hook", "full"), ("random", None), ("hook", "sharded")):
        # The hook's step: the first after `first` whose save has the layout (save_loop: even steps shard).
        doomed = first + 1 if ((first + 1) % 2 == 0) == (layout == "sharded") else first + 2
        env = clean_env(**{checkpoint.KILL_IN_SAVE: str(doomed)}) if how == "hook" else clean_env()
        proc = subprocess.Popen(
            [sys.executable, SAVE_LOOP, str(tmp_path), str(first)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout.readline() == f"saved {first}\n"  # one complete save, then the kill
        if how == "random":
            time.sleep(rng.uniform(0.0, 0.8))
            proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        printed = [first, *(int(line.split()[1]) for line in rest.splitlines())]
        if how == "hook":  # it fires inside step `doomed`'s save only: the loop got no further
            assert printed[-1] == doomed - 1, f"the hook did not stop the save of step {doomed}: saved {printed}"
            newest = doomed - 1
            inside += 1
        else:  # a kill after a save's last rename and before its "saved" line: that one completed too
            newest = printed[-1] + checkpoint.step_path(tmp_path, printed[-1] + 1).is_dir()
            inside += any(p.name.endswith((".partial", ".old")) for p in tmp_path.iterdir())
        for path in checkpoint.list_checkpoints(tmp_path):
            checkpoint.verify(path)  # every published checkpoint is whole
        found = checkpoint.newest_good(fleet, tmp_path)  # what --resume takes
        assert found, "a kill left no loadable checkpoint"
        assert found[0] == checkpoint.step_path(tmp_path, newest), f"{how}: found {found[0].name}, newest {newest}"
        extra = fleet.load(found[0])
        assert extra["step"] == newest and all(torch.all(p == newest) for p in net.parameters())
        first = newest + 1
    assert inside >= 2  # the hook's two at least; the random one may land between saves
    print(f"{inside} of 3 kills landed inside a save")


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
