"""The router's load-balancing loss over a data-parallel group (strategies/moe_balance.py), in one process.

The zoo's cells (tests/strategies/test_zoo.py) hold ddp, fsdp and hsdp to serial's weights with the loss on, on
2 and 4 processes; here the formula is checked against transformers' own, which the strategies leave
in place for serial, so that a change in transformers shows up as a failure rather than a drift.
"""

from __future__ import annotations

import importlib

import torch

from helpers import require_module
from torchfleet.strategies.moe_balance import RouterLoss, balance_loss, balance_over, router_loss

require_module("transformers", "transformers (the test extra) builds the MoE models from configs")

import zoo  # noqa: E402 (after the skip: zoo imports transformers lazily)


def _router_logits(name: str, batch):
    torch.manual_seed(0)
    net = zoo.ZOO[name].build()
    return net, net(**batch).router_logits


def test_with_no_group_it_is_transformers_own_loss_with_and_without_padding():
    for name, make in (("hf-mixtral-aux", zoo._ids), ("hf-qwen2-moe-aux", zoo._ragged)):
        inputs, _ = make(8, 0)
        net, logits = _router_logits(name, inputs)
        settings = router_loss(net)
        library = importlib.import_module(type(net).__module__).load_balancing_loss_func
        for mask in (None, inputs.get("attention_mask")):
            want = library(logits, settings.experts, settings.top_k, mask)
            got = balance_loss(logits, settings, mask, [])
            assert abs(got.item() - want.item()) < 1e-6, (name, mask is not None, got.item(), want.item())


def test_the_settings_are_read_only_where_the_config_turns_the_loss_on():
    torch.manual_seed(0)
    assert router_loss(zoo.ZOO["hf-mixtral"].build()) is None  # the default: output_router_logits off
    assert router_loss(zoo.ZOO["hf-mixtral-aux"].build()) == RouterLoss(4, 2, zoo.ROUTER_AUX_COEF)
    assert router_loss(zoo.ZOO["hf-qwen2-moe-aux"].build()) == RouterLoss(4, 2, 0.001)
    assert router_loss(zoo.ZOO["hf-llama"].build()) is None
    assert balance_over(zoo.ZOO["hf-mixtral-aux"].build(), []) is None  # no other rank: nothing to count with
