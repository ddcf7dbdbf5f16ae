"""`torchfleet train` end to end: the summary's figures, and checkpoints that resume."""

import json

import pytest

from helpers import newest_checkpoint_model, torchfleet

FIELDS = {
    "strategy",
    "world_size",
    "backend",
    "epochs",
    "steps",
    "final_loss",
    "val_accuracy",
    "samples_per_s",
    "wall_s",
}


@pytest.mark.timeout(180)
def test_ddp_train_writes_summary_json(tmp_path):
    out = tmp_path / "result.json"
    result = torchfleet(
        "train", "--strategy", "ddp", "-n", "2", "--epochs", "2", "--json-out", str(out), "--no-progress"
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert FIELDS <= set(figures)
    assert figures["strategy"] == "ddp" and figures["world_size"] == 2 and figures["backend"] == "gloo"
    assert figures["steps"] == 2 * (1438 // 64)  # 80% of 1,797 digits, whole global batches only
    assert figures["val_accuracy"] > 0.9
    assert figures["samples_per_s"] > 0 and figures["final_loss"] < 0.5
    assert "validation accuracy" in result.stdout and "gloo" in result.stdout


@pytest.mark.timeout(180)
def test_resume_continues_to_the_same_weights(tmp_path):
    common = [
        "train",
        "--strategy",
        "serial",
        "--model",
        "mlp",
        "--epochs",
        "3",
        "--no-progress",
        "--checkpoint-every",
        "5",
    ]
    straight = tmp_path / "straight"
    assert torchfleet(*common, "--checkpoint-dir", str(straight)).returncode == 0
    stopped = tmp_path / "stopped"
    first = torchfleet(*common, "--checkpoint-dir", str(stopped), "--max-steps", "25")
    assert first.returncode == 0, first.stderr
    resumed = torchfleet(*common, "--checkpoint-dir", str(stopped), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step 25" in resumed.stdout

    import torch

    name_a, a = newest_checkpoint_model(straight)
    name_b, b = newest_checkpoint_model(stopped)
    assert name_a == name_b
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bit for bit
    assert len(list(stopped.glob("step-*"))) == 3  # only the newest three are kept
