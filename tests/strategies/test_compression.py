"""Gradient compression (DDP communication hooks): still learns, and really changes what is sent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchfleet import UsageError, launch
from torchfleet.fleet import Fleet
from torchfleet.strategies.ddp import DataParallelDistributed
from torchfleet.strategies.options import StrategyOptions
from torchfleet.testing.equivalence import full_weights
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import mlp

CASES = [{}, {"grad_compression": "fp16"}, {"grad_compression": "powersgd", "powersgd_rank": 1}]


def _train(options: dict, steps: int = 40) -> dict:
    fleet = Fleet(strategy="ddp", **options)
    torch.manual_seed(0)
    net = mlp(hidden=512)  # 1 MiB of weights in one layer: DDP makes 2 buckets, as real models do
    model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = fleet.dataloader(synthetic(32 * steps, shape=(1, 8, 8), seed=0), 32, seed=0)
    losses = [fleet.all_reduce(fleet.train_step(x, y, nn.CrossEntropyLoss())).item() for x, y in loader]
    return {
        "hook": model._get_ddp_logging_data().get("comm_hook", ""),
        "first": sum(losses[:5]) / 5,
        "last": sum(losses[-5:]) / 5,
        "weights": full_weights(fleet),
    }


def _all_cases() -> list[dict]:
    results = [_train(case) for case in CASES]
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return results


@pytest.mark.timeout(240)
def test_fp16_and_powersgd_learn_and_change_the_traffic():
    plain, fp16, powersgd = launch(_all_cases, nprocs=2)[0]
    assert plain["hook"] == "" and fp16["hook"] == "fp16_compress_hook"
    assert powersgd["hook"] == "powerSGD_hook"
    for result in (plain, fp16, powersgd):
        assert result["last"] < 0.85 * result["first"], result  # the loss falls

    def gap(result):  # relative distance from plain DDP's weights
        return ((result["weights"] - plain["weights"]).norm() / plain["weights"].norm()).item()

    print(f"relative distance from plain DDP: fp16 {gap(fp16):.2e}, powersgd {gap(powersgd):.2e}")
    # fp16 rounds the averaged gradient: close to plain DDP, but not bit-equal.
    assert 0 < gap(fp16) < 1e-3
    # Rank-1 PowerSGD sends a low-rank approximation: a different trajectory, not rounding.
    assert gap(powersgd) > 20 * gap(fp16)
    assert abs(powersgd["last"] - plain["last"]) < 0.5


@pytest.mark.parametrize(
    "options,sentence",
    [
        ({"grad_compression": "zip"}, "unknown gradient compression 'zip'; choose one of none, fp16, bf16, powersgd"),
        ({"powersgd_rank": 4}, "--powersgd-rank 4 needs --grad-compression powersgd"),
        ({"grad_compression": "powersgd", "powersgd_rank": 0}, "--powersgd-rank 0 must be at least 1"),
        ({"grad_compresion": "fp16"}, "option 'grad_compresion' does not apply to strategy 'ddp'"),
    ],
)
def test_bad_compression_options_are_one_sentence(options, sentence):
    with pytest.raises(UsageError, match=sentence.replace("(", r"\(")):
        DataParallelDistributed(None, StrategyOptions.of(options))  # type: ignore[arg-type]
