"""What a GPU run gets by default (channels-last convolutions, fused AdamW, the loss compiled with the whole
model), checked here on the CPU where the switch can be forced: the same function is computed either way.
The speed they are for is measured by `make gpu-check` (docs/benchmarks)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchfleet import Fleet
from torchfleet.memory_format import wants_channels_last
from torchfleet.models import cnn, mlp, resnet18
from torchfleet.train.models import build_optimizer

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_channels_last_is_chosen_for_convolutions_in_half_precision_on_a_gpu_only():
    conv, dense = resnet18((3, 32, 32), 10), mlp()
    assert wants_channels_last(None, conv, "bf16", CUDA) and wants_channels_last(None, conv, "fp16", CUDA)
    assert not wants_channels_last(None, conv, "fp32", CUDA)  # TF32 convolutions gain little from it
    assert not wants_channels_last(None, conv, "bf16", CPU)
    assert not wants_channels_last(None, dense, "bf16", CUDA)  # nothing to lay out
    assert wants_channels_last(True, conv, "fp32", CPU) and not wants_channels_last(False, conv, "bf16", CUDA)
    assert not wants_channels_last(True, dense, "fp32", CPU)


def _trained(channels_last: bool | None, compile: bool | str = False, model_fn=cnn, steps: int = 4):
    torch.manual_seed(0)
    model = model_fn()
    fleet = Fleet("serial", channels_last=channels_last, compile=compile)
    # SGD: Adam's first steps divide by the gradients' own size, which turns rounding into visible moves.
    optimizer = build_optimizer("sgd", model.parameters(), 1e-2, fleet.device)
    model, optimizer = fleet.setup(model, optimizer)
    gen = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    losses = [fleet.train_step(inputs, targets, nn.functional.cross_entropy).item() for _ in range(steps)]
    return fleet, model, optimizer, losses


def test_a_channels_last_model_trains_to_the_same_weights(monkeypatch):
    # On a GPU, fp32 convolutions run in TF32 by default, whose 10-bit products each layout sums differently.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    fleet, model, _, losses = _trained(True)
    assert fleet.channels_last and any("channels_last" in n for n in fleet.notes)
    conv = model[2]  # 32 -> 64 channels: the first, of one input channel, is both layouts at once
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
    assert fleet.to_device(torch.randn(2, 1, 8, 8)).is_contiguous(memory_format=torch.channels_last)
    plain, plain_model, _, plain_losses = _trained(None)
    assert not plain.channels_last and plain_model[2].weight.is_contiguous()
    assert losses[-1] < losses[0]  # it learns
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-5  # the same function: only the kernels' sums differ


def test_adamw_is_fused_on_a_gpu_and_left_as_torch_builds_it_elsewhere():
    params = [nn.Parameter(torch.zeros(3))]
    assert not build_optimizer("adamw", params, 1e-3, CPU).defaults.get("fused")
    assert not build_optimizer("adamw", params, 1e-3).defaults.get("fused")
    if torch.cuda.is_available():
        assert build_optimizer("adamw", [nn.Parameter(torch.zeros(3, device="cuda"))], 1e-3, CUDA).defaults["fused"]


def test_whole_model_compile_compiles_the_loss_with_it_and_computes_the_same():
    fleet, model, _, losses = _trained(None, compile="model", model_fn=mlp, steps=3)
    compiled = fleet.strategy._compiled_loss
    assert compiled is not None and compiled[0] is nn.functional.cross_entropy
    assert compiled[1] is not nn.functional.cross_entropy  # the compiled form ran
    eager, eager_model, _, eager_losses = _trained(None, model_fn=mlp, steps=3)
    assert eager.strategy._compiled_loss is None
    assert max(abs(a - b) for a, b in zip(losses, eager_losses, strict=True)) < 1e-5
    for a, b in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: `make gpu-check` runs it there")
def test_on_a_gpu_a_convolution_model_in_bf16_is_channels_last_and_its_adamw_fused_by_default():
    torch.manual_seed(0)
    fleet = Fleet("serial", precision="bf16")
    model = resnet18((3, 32, 32), 10)
    optimizer = build_optimizer("adamw", model.parameters(), 1e-3, fleet.device)
    model, optimizer = fleet.setup(model, optimizer)
    assert fleet.channels_last and model.layer1[0].conv1.weight.is_contiguous(memory_format=torch.channels_last)
    inputs, targets = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    losses = [fleet.train_step(inputs, targets, nn.functional.cross_entropy).item() for _ in range(3)]
    assert optimizer.defaults["fused"] and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
