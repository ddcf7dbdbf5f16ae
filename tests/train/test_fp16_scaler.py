"""fp16's gradient scaler: an overflowing step is skipped on every rank, and a diverged run stops.

fp16 is offered on CUDA only, but torch's GradScaler and fp16 autocast run on
the CPU too; these tests add "cpu" to `precision.FP16_DEVICES` so the skip
logic (and, for sharded strategies, the all-reduced overflow verdict) runs
for real on a machine without a GPU.
"""

import pytest
import torch

from torchfleet import launch, precision
from torchfleet.errors import TrainingError
from torchfleet.testing.devices import fp16_skip_job
from torchfleet.train.config import TrainConfig
from torchfleet.train.loop import train
from torchfleet.train.losses import FP16_NONFINITE_LIMIT

STEPS, POISONED = 5, 3  # steps are counted from 1
INITIAL_SCALE = 65536.0  # GradScaler's default; it grows only after 2000 clean steps


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, options", [("ddp", {}), ("fsdp", {}), ("pipeline", {"microbatches": 2})])
def test_an_overflow_on_one_rank_skips_that_step_on_every_rank(strategy, options):
    # (Checked: with `Precision.sync_overflow` switched off the pipeline case fails, rank 0
    # taking the step rank 1 skips; fsdp's DTensor gradients share the verdict by themselves.)
    ranks = launch(fp16_skip_job, nprocs=2, args=(strategy, options, STEPS, POISONED, True))
    halved = INITIAL_SCALE / 2
    for result in ranks:  # every rank's scaler saw the overflow, once
        assert result["scales"] == [INITIAL_SCALE] * (POISONED - 1) + [halved] * (STEPS - POISONED + 1)
    weights = ranks[0]["weights"]
    for step in range(1, STEPS + 1):
        moved = (weights[step] - weights[step - 1]).abs().max().item()
        if step == POISONED:
            assert moved == 0, f"step {step} was taken on some rank (weights moved {moved:.3g})"
        else:
            assert moved > 1e-4, f"step {step} was skipped"
    assert all(torch.isfinite(w).all() for w in weights)


def test_a_diverged_fp16_run_stops_after_the_limit_of_skipped_steps(monkeypatch, capsys):
    monkeypatch.setattr(precision, "FP16_DEVICES", ("cuda", "cpu"))
    # lr 1e6 drives the weights to inf within a few steps; from then every loss is NaN.
    cfg = TrainConfig(
        model="mlp",
        data="synthetic",
        synthetic_size=2048,
        batch_size=32,
        epochs=1,
        optimizer="sgd",
        lr=1e6,
        precision="fp16",
        progress=False,
        hang_timeout=0,
    )
    with pytest.raises(TrainingError) as caught:
        train(cfg, "serial")
    message = str(caught.value)
    assert f"for {FP16_NONFINITE_LIMIT} steps in a row" in message
    step = int(message.split("up to step ")[1].split()[0])
    assert FP16_NONFINITE_LIMIT <= step < 2048 // 32  # stopped before the epoch ended
    scale = float(message.split("lowered its scale to ")[1].split(";")[0])
    assert scale <= INITIAL_SCALE / 2**FP16_NONFINITE_LIMIT  # halved once per skipped step


def test_fp16_is_refused_on_cpu_without_the_test_switch():
    assert precision.FP16_DEVICES == ("cuda",)
    with pytest.raises(Exception, match="precision fp16 needs a CUDA device"):
        precision.Precision("fp16", torch.device("cpu"))
