"""diloco and localsgd: replica groups that meet every few steps on torchft (replica_groups/outer_step.py), on one machine.

Groups are separate `torchfleet train` commands (node ranks at 127.0.0.1, as test_ft.py starts them) or one
`torchfleet train -n 2`, with real processes, torchft's lighthouse and real sockets. What is checked: with one
step between meetings and an outer step of 1 without momentum both equal serial (the arithmetic is right),
every group ends with the same weights, a run stopped between meetings and resumed equals a straight one
bit for bit, a group killed between meetings heals at the next and both end alike, and bad input is one
sentence and status 2. Speed over slow links is benchmarks/slow_text.py's (docs/benchmarks/history.md).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from helpers import require_module, torchfleet
from test_ft import MLP, _groups, _max_diff, _serial, one_group_killed, outside_replica_groups, refused_in_one_sentence

# Groups meet, wait out a lost peer's timeout and heal: 570 s of CI's wall for 180 CPU-seconds. `make test` runs it
# beside the computing parts (the Makefile's `waits` run).
pytestmark = pytest.mark.waits

require_module("torchft", "diloco and localsgd run on torchft (the dev extra installs it)")


def _weights(tmp, groups: int = 2) -> list[dict]:
    return [torch.load(tmp / f"group{g}.pt", weights_only=True) for g in range(groups)]


def _same(states: list[dict]) -> bool:
    return all(torch.equal(s[k], states[0][k]) for s in states for k in s)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "method,nproc",
    [pytest.param("diloco", 1, marks=pytest.mark.slow), ("localsgd", 1), ("diloco", 2)],  # 2x2 holds 2x1's path
    ids=["diloco-2x1", "localsgd-2x1", "diloco-2x2"],
)
def test_meeting_every_step_with_a_plain_outer_step_equals_serial(method, nproc, tmp_path):
    """Inner SGD, a meeting after every step: localsgd's average of the weights and diloco's outer step of
    lr 1 without momentum on the averaged change both give the weights ddp's averaged gradient gives (SGD's
    momentum is linear, so the groups' average follows ddp's), which are serial's on the global batch; with
    2 processes a group, ddp inside each group first."""
    common = [*MLP, "--epochs", "1", "--max-steps", "10", "--optimizer", "sgd", "--lr", "0.05"]
    outer = ["--outer-lr", "1", "--outer-momentum", "0"] if method == "diloco" else []
    runs = _groups(2, [*common, "--strategy", method, "--sync-every", "1", *outer], tmp_path, nproc=nproc)
    assert [s for s, _ in runs] == [0, 0], runs
    weights = _weights(tmp_path)
    assert _same(weights)
    diff = _max_diff(weights[0], _serial(common, tmp_path))
    print(f"{method}, sync every step: max |weight - serial's| = {diff:.3g}")
    assert diff < 1e-5
    summary = json.loads((tmp_path / "group0.json").read_text())
    assert (summary["strategy"], summary["steps"], summary["replica_groups"]) == (method, 10, 2)


@pytest.mark.timeout(300)
def test_diloco_groups_train_apart_between_meetings_and_end_alike(tmp_path):
    """sync_every 5 with AdamW inside and the paper's outer step: not serial (the README says so), but the
    loss falls, every group ends with the same weights after the last meeting, and they differ from serial's."""
    common = [*MLP, "--epochs", "2"]
    runs = _groups(2, [*common, "--strategy", "diloco", "--sync-every", "5", "--log-every", "5"], tmp_path)
    assert [s for s, _ in runs] == [0, 0], runs
    weights = _weights(tmp_path)
    assert _same(weights)
    assert _max_diff(weights[0], _serial(common, tmp_path)) > 1e-3  # a different method, not a rounding
    summary = json.loads((tmp_path / "group0.json").read_text())
    serial = json.loads((tmp_path / "serial.json").read_text())
    assert summary["val_accuracy"] > 0.8 and abs(summary["val_accuracy"] - serial["val_accuracy"]) < 0.1


def _replicas_saved(run, step: int) -> dict:
    """What group 0 saved of its place between meetings in the checkpoint of `step`."""
    ranks = torch.load(run / "ckpt" / "group0" / f"step-{step:08d}" / "ranks.pt", weights_only=True)
    return ranks[0]["extra"]["replicas"]


@pytest.mark.timeout(300)
def test_a_diloco_meeting_takes_the_outer_nesterov_step_on_the_averaged_change(tmp_path):
    """Three inner steps, then one meeting with outer SGD at lr 0.7 and Nesterov momentum 0.9. By hand: the
    groups' averaged change is D = w0 - mean(w_g), Nesterov's first step uses D + 0.9 x buffer with the buffer
    D, so the weights after the meeting are w0 - 0.7 x 1.9 x D. w0 is the weights at the first meeting (the
    step-1 checkpoint holds them); mean(w_g) is what the same run with an outer step of lr 1 and no momentum
    ends with (its inner steps are the same). An outer optimizer that ignored the flags would give mean(w_g)."""
    lr, momentum = 0.7, 0.9
    common = [
        *MLP,
        "--strategy",
        "diloco",
        "--sync-every",
        "3",
        "--epochs",
        "1",
        "--max-steps",
        "3",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "5",
    ]
    paper, plain = tmp_path / "paper", tmp_path / "plain"
    for run, outer in ((paper, [str(lr), str(momentum)]), (plain, ["1", "0"])):
        run.mkdir()
        runs = _groups(
            2,
            [*common, "--outer-lr", outer[0], "--outer-momentum", outer[1], "--checkpoint-dir", str(run / "ckpt")],
            run,
        )
        assert [s for s, _ in runs] == [0, 0], runs
    after, average = _weights(paper), _weights(plain)
    assert _same(after) and _same(average)
    start = dict(zip(after[0], _replicas_saved(paper, 1)["at_meeting"], strict=True))
    outer = _replicas_saved(paper, 3)["outer_optimizer"]
    assert (outer["param_groups"][0]["lr"], outer["param_groups"][0]["momentum"]) == (lr, momentum)
    buffers = [outer["state"][i]["momentum_buffer"] for i in sorted(outer["state"])]
    worst = 0.0
    for (name, weight), buffer in zip(after[0].items(), buffers, strict=True):
        change = start[name] - average[0][name]
        assert torch.allclose(buffer, change, atol=1e-6), f"{name}: the momentum buffer is not the averaged change"
        expected = start[name] - lr * (change + momentum * change)
        worst = max(worst, (weight - expected).abs().max().item())
    print(f"diloco, one meeting at lr {lr}, momentum {momentum}: max |weight - by hand| = {worst:.3g}")
    assert worst < 1e-6
    assert _max_diff(after[0], average[0]) > 1e-3  # the outer step is not the plain average


@pytest.mark.timeout(420)
def test_a_diloco_run_stopped_between_meetings_resumes_bit_for_bit(tmp_path):
    """Checkpoints every 3 steps, meetings every 4: the checkpoint at step 6 is two steps after a meeting. A run
    resumed from it (its weights, both optimizers, the weights at the last meeting, the position) ends with
    exactly the weights of the run that went straight through."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    argv = [
        *MLP,
        "--strategy",
        "diloco",
        "--sync-every",
        "4",
        "--epochs",
        "1",
        "--max-steps",
        "14",
        "--checkpoint-every",
        "3",
        "--keep-checkpoints",
        "10",
    ]
    straight.mkdir()
    runs = _groups(2, [*argv, "--checkpoint-dir", str(straight / "ckpt")], straight)
    assert [s for s, _ in runs] == [0, 0], runs
    saved = torch.load(straight / "ckpt" / "group1" / "step-00000006" / "ranks.pt", weights_only=True)[0]["extra"][
        "replicas"
    ]
    assert (saved["position"], saved["local"]) == (6, 2) and len(saved["at_meeting"]) > 0
    resumed.mkdir()
    for g in range(2):
        shutil.copytree(
            straight / "ckpt" / f"group{g}" / "step-00000006", resumed / "ckpt" / f"group{g}" / "step-00000006"
        )
    runs = _groups(2, [*argv, "--checkpoint-dir", str(resumed / "ckpt"), "--resume"], resumed)
    assert [s for s, _ in runs] == [0, 0], runs
    assert "resumed from" in runs[0][1] + runs[1][1]
    for a, b in zip(_weights(straight), _weights(resumed), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's weights differ from the straight run's"


@pytest.mark.timeout(300)
def test_a_group_killed_between_meetings_heals_at_the_next_and_the_other_never_waits_long(tmp_path):
    """Group 1's worker is killed at step 7 (meetings every 5); its agent starts it again, it meets group 0 at
    its next meeting and heals from it; group 0 never restarts, and both end with the same weights."""
    argv = [*MLP, "--strategy", "diloco", "--sync-every", "5", "--epochs", "3", "--log-every", "5"]
    outputs = one_group_killed(argv, 7, tmp_path)  # group 0 paced from step 7 until group 1 has healed
    healed = re.search(r"group 1 healed from group 0 at step (\d+)", outputs[1])
    assert healed and int(healed.group(1)) > 7 and int(healed.group(1)) % 5 == 0, outputs[1]  # at a meeting
    # Group 0's account of it: group 1 left at the meeting and later joined and healed; or, when its agent
    # started it again within the 3 s the lighthouse waits for heartbeats, one line for both (seen once here).
    left_and_joined = re.search(r"group 1 left at step 10: group 0 went on after a pause of", outputs[0]) and re.search(
        r"group 1 joined at step \d+ and healed from this group \(0\)", outputs[0]
    )
    back_at_once = re.search(
        r"group 1 was lost and started again at step 10, healing from this group \(0\);"
        r" groups 0, 1 went on after a pause of",
        outputs[0],
    )
    assert left_and_joined or back_at_once, outputs[0]
    assert "resumed from" not in outputs[1]
    assert _same(_weights(tmp_path))
    summaries = [json.loads((tmp_path / f"group{g}.json").read_text()) for g in range(2)]
    assert summaries[0]["steps"] == summaries[1]["steps"]


@pytest.mark.timeout(300)
def test_train_on_one_machine_runs_a_group_per_process(tmp_path):
    """`torchfleet train --strategy localsgd -n 2`: two groups of one process, the first's output and files."""
    out = torchfleet(
        "train",
        *MLP,
        "--strategy",
        "localsgd",
        "--sync-every",
        "1",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--epochs",
        "1",
        "--max-steps",
        "6",
        "-n",
        "2",
        "--json-out",
        str(tmp_path / "run.json"),
        "--save-model",
        str(tmp_path / "model.pt"),
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("torchfleet train") == 1  # one summary: the first group's
    summary = json.loads((tmp_path / "run.json").read_text())
    assert (summary["strategy"], summary["replica_groups"], summary["steps"]) == ("localsgd", 2, 6)
    expected = _serial([*MLP, "--epochs", "1", "--max-steps", "6", "--optimizer", "sgd", "--lr", "0.05"], tmp_path)
    assert _max_diff(torch.load(tmp_path / "model.pt", weights_only=True), expected) < 1e-5


BAD = {
    "sync every 0": (
        ["--strategy", "diloco", "-n", "2", "--sync-every", "0"],
        "--sync-every 0 must be a whole number of steps, at least 1",
    ),
    "outer lr 0": (["--strategy", "diloco", "-n", "2", "--outer-lr", "0"], "--outer-lr 0.0 must be a positive"),
    "outer lr negative": (
        ["--strategy", "diloco", "-n", "2", "--outer-lr", "-0.5"],
        "--outer-lr -0.5 must be a positive",
    ),
    "momentum 1": (
        ["--strategy", "diloco", "-n", "2", "--outer-momentum", "1"],
        "--outer-momentum 1.0 must be at least 0 and below 1",
    ),
    "one process": (
        ["--strategy", "diloco", "-n", "1"],
        "diloco on one process (or one replica group) has no one to meet",
    ),
    "localsgd outer lr": (
        ["--strategy", "localsgd", "-n", "2", "--outer-lr", "0.5"],
        "localsgd averages the weights and has no outer optimizer",
    ),
    "sync every on ddp": (
        ["--strategy", "ddp", "-n", "2", "--sync-every", "5"],
        "option 'sync_every' does not apply to strategy 'ddp'",
    ),
}


@pytest.mark.parametrize("flags,sentence", BAD.values(), ids=BAD.keys())
def test_bad_meeting_input_is_one_sentence_and_status_2(flags, sentence, capsys):
    assert sentence in refused_in_one_sentence(flags, capsys)


def test_without_torchft_diloco_is_refused_saying_what_to_install(monkeypatch, capsys):
    from torchfleet.replica_groups import torchft_setup

    monkeypatch.setattr(torchft_setup, "version", lambda: None)
    assert "diloco runs on torchft, which cannot run here: torchft is not installed" in refused_in_one_sentence(
        ["--strategy", "diloco", "-n", "2"], capsys
    )


def test_a_fleet_outside_replica_groups_refuses_diloco(monkeypatch):
    from torchfleet import Fleet, UsageError

    outside_replica_groups(monkeypatch)
    with pytest.raises(UsageError, match="diloco meets across replica groups, and this process is in none"):
        Fleet(strategy="diloco")
