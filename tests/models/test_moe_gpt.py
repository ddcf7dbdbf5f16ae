"""`gpt-moe`: the built-in gpt with a mixture of experts in every block (models/moe.py).

The experts' forward against a per-token loop, the router's renormalised
top-k, the per-expert token counts, the load-balancing loss on routings whose
value is known, the layout transformers' Mixtral uses, and training under
ddp, fsdp, the pipeline and tp on 2 processes against serial's weights.
Measured on 2 CPU cores with torch 2.14.1: every strategy within 1e-8 of serial.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import torchfleet
from torchfleet import launch
from torchfleet.errors import UsageError
from torchfleet.models import GPT, TOKEN_MODELS, GPTConfig, build_model, lm_loss
from torchfleet.models.moe import Experts, MoEFeedForward, Router, aux_loss, load_balancing_loss
from torchfleet.strategies.expert_load import ExpertLoad
from torchfleet.testing.real_models import real_model, real_model_matrix, train_real_model

SMALL = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32, experts=4, top_k=2)


def _naive(experts: Experts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice: sum_k w_k * down(silu(gate) * up) of the chosen experts."""
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1], dtype=x.dtype)
        for k in range(index.shape[1]):
            e = int(index[t, k])
            if e == experts.num_experts:  # another process's expert (expert parallelism's mark)
                continue
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            total = total + weights[t, k] * (experts.down_proj[e] @ (F.silu(gate) * up))
        rows.append(total)
    return torch.stack(rows)


def test_experts_equal_a_per_token_loop_and_an_unchosen_expert_gets_a_zero_gradient():
    torch.manual_seed(0)
    experts = Experts(num_experts=5, hidden=8, intermediate=12)
    x = torch.randn(10, 8)
    index = torch.randint(0, 4, (10, 2))  # expert 4 is never chosen
    index[3, 1] = 5  # a choice marked as held elsewhere: skipped
    weights = torch.rand(10, 2)
    got = experts(x, index, weights)
    want = _naive(experts, x, index, weights)
    assert got.shape == (10, 8) and (got - want).abs().max().item() < 1e-6
    got.sum().backward()
    assert experts.gate_up_proj.grad[4].abs().max().item() == 0.0
    assert experts.down_proj.grad[4].abs().max().item() == 0.0
    assert experts.gate_up_proj.grad[:4].abs().amin(dim=(1, 2)).gt(0).any()


def test_router_takes_the_top_k_of_the_softmax_renormalised():
    torch.manual_seed(0)
    router = Router(num_experts=6, hidden=8, top_k=2)
    x = torch.randn(7, 8)
    logits, weights, index = router(x)
    probs = (x @ router.weight.T).softmax(dim=-1)
    top, want_index = probs.topk(2, dim=-1)
    assert logits.shape == (7, 6) and index.dtype == torch.long
    assert torch.equal(index, want_index)
    assert torch.allclose(weights, top / top.sum(dim=-1, keepdim=True))
    assert torch.allclose(weights.sum(dim=-1), torch.ones(7))


def test_tokens_per_expert_count_every_choice():
    torch.manual_seed(0)
    model = GPT(SMALL)
    load = ExpertLoad(model)  # what train's summary reads, as for any model with experts
    model(torch.randint(0, 97, (3, 16)))
    assert load.counts is not None and load.counts.dtype == torch.long
    assert int(load.counts.sum()) == 3 * 16 * 2 * 2  # tokens * top_k, in each of the 2 blocks
    assert len(load.counts) == 4 and abs(sum(load.shares(torch.device("cpu"))) - 1) < 1e-12
    assert not any("tokens_per_expert" in key for key in model.state_dict())  # a count, not a weight


def test_load_balancing_loss_on_known_routings():
    # Uniform probabilities: E * sum_i f_i / E = 1, whatever the choice.
    index = torch.tensor([[0], [0], [1], [3]])
    assert load_balancing_loss(torch.zeros(4, 4), index, 4).item() == pytest.approx(1.0)
    # Two tokens, both with probabilities (0.75, 0.25), both to expert 0: 2 * (1 * 0.75 + 0 * 0.25) = 1.5.
    logits = torch.tensor([[0.75, 0.25], [0.75, 0.25]]).log()
    assert load_balancing_loss(logits, torch.tensor([[0], [0]]), 2).item() == pytest.approx(1.5)
    # top-2 of 4: f = (2, 1, 1, 0) / 4 choices, P = (0.4, 0.3, 0.2, 0.1): 4 * (0.2 + 0.075 + 0.05) = 1.3.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]).log()
    assert load_balancing_loss(logits, torch.tensor([[0, 1], [0, 2]]), 4).item() == pytest.approx(1.3)
    # Every token certain of one expert: E.
    assert load_balancing_loss(torch.tensor([[50.0, 0, 0]] * 3), torch.zeros(3, 1, dtype=torch.long), 3).item() == (
        pytest.approx(3.0)
    )


def test_the_aux_loss_is_off_unless_asked_and_trains_the_router():
    torch.manual_seed(0)
    idx = torch.randint(0, 97, (2, 16))
    plain = GPT(SMALL)
    plain(idx)
    assert plain.blocks[0].mlp.aux_loss is None
    with pytest.raises(ValueError, match="no MoE block kept a load-balancing loss"):
        aux_loss(plain)
    model = GPT(GPTConfig(**{**SMALL.__dict__, "moe_aux_loss": True}))
    logits = model(idx)
    kept = [block.mlp.aux_loss for block in model.blocks]
    total = aux_loss(model)
    assert total.item() == pytest.approx(sum(k.item() for k in kept)) and 1.0 <= total.item() / 2 <= 4.0
    (lm_loss(logits, idx) + 0.01 * total).backward()
    assert model.blocks[0].mlp.gate.weight.grad.abs().max().item() > 0


def test_transformers_counts_the_same_loss_per_token():
    transformers = pytest.importorskip("transformers.models.mixtral.modeling_mixtral", reason="transformers not here")
    torch.manual_seed(0)
    logits = torch.randn(12, 8)
    _, index = logits.softmax(dim=-1).topk(2, dim=-1)
    theirs = transformers.load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert load_balancing_loss(logits, index, 8).item() == pytest.approx(theirs.item() / 2, rel=1e-6)


def test_gpt_moe_has_mixtrals_layout_and_size():
    with torch.device("meta"):
        model = build_model("gpt-moe")
    assert "gpt-moe" in TOKEN_MODELS and model.config.experts == 8 and model.config.top_k == 2
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["blocks.3.mlp.gate.weight"] == (8, 64)
    assert shapes["blocks.3.mlp.experts.gate_up_proj"] == (8, 2 * 256, 64)
    assert shapes["blocks.3.mlp.experts.down_proj"] == (8, 64, 256)
    assert not any(".mlp.fc." in k for k in shapes)
    # tiny's 236,928, less 4 dense MLPs (33,088 each), plus 4 routers and 8 experts each of 3 * 64 * 256.
    assert sum(p.numel() for p in model.parameters()) == 236_928 - 4 * 33_088 + 4 * (8 * 64 + 8 * 3 * 64 * 256)
    with pytest.raises(UsageError, match="top_k=3 must be between 1 and experts=2"):
        GPTConfig(experts=2, top_k=3)


def test_gpt_moe_init_scales_the_residual_projection():
    torch.manual_seed(0)
    model = build_model("gpt-moe")
    assert model.blocks[0].mlp.experts.gate_up_proj.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.experts.down_proj.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)


def test_tp_splits_attention_and_leaves_the_experts_whole():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = GPT(SMALL)
    plan = model.tp_plan(2)
    assert len(plan) == 4 * SMALL.n_layer and set(plan) <= set(dict(model.named_modules()))
    assert all(".attn." in name for name in plan)
    assert {type(plan["blocks.1.attn.q"]), type(plan["blocks.1.attn.proj"])} == {ColwiseParallel, RowwiseParallel}
    assert isinstance(model.blocks[1].mlp, MoEFeedForward)


# ---- under the strategies ----------------------------------------------------------------

STRATEGIES = ["ddp", "fsdp", "pipeline", "tp"]
CASE = {"model": "gpt-moe"}


@functools.lru_cache(maxsize=None)
def _launched() -> dict:
    results = launch(real_model_matrix, nprocs=2, args=([(s, [CASE]) for s in STRATEGIES],))
    return {s: got[0] for s, got in zip(STRATEGIES, results[0], strict=True)}


@functools.lru_cache(maxsize=None)
def _serial() -> dict:
    return train_real_model("serial", **CASE)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_equals_serial(strategy):
    want, got = _serial(), _launched()[strategy]
    assert set(got) == set(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    print(f"gpt-moe under {strategy}: max weight difference {diff:.3g} from serial")
    assert diff < 1e-5, f"gpt-moe under {strategy}: max weight difference {diff:.3g} from serial"


def test_serial_training_moved_every_expert():
    torch.manual_seed(0)  # as train_real_model builds it
    start = real_model("gpt-moe").state_dict()
    trained = _serial()
    for name in (k for k in trained if "experts" in k):
        moved = (trained[name] - start[name]).flatten(1).abs().amax(dim=1)
        assert moved.shape == (4,) and bool((moved > 0).all()), name


@pytest.mark.timeout(120)
def test_train_gpt_moe_from_the_command_line(tmp_path):
    out = tmp_path / "result.json"
    argv = ("train", "--model", "gpt-moe", "--strategy", "serial", "--epochs", "1", "--max-steps", "3")
    result = torchfleet(*argv, "--hang-timeout", "0", "--no-progress", "--json-out", str(out))
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert figures["model"] == "gpt-moe" and figures["gpt_preset"] == "tiny" and figures["data"] == "text"
    assert figures["final_loss"] < math.log(256)


def test_plan_counts_the_experts_as_whole_on_every_tp_rank():
    from torchfleet.plan.layouts import Layout
    from torchfleet.plan.predict import _rank_parameters
    from torchfleet.plan.profile import Profile
    from torchfleet.plan.profiler import _shape

    torch.manual_seed(0)
    model = build_model("gpt-moe")
    shape = _shape(model, torch.randint(0, 256, (2, 64)))
    moe = sum(p.numel() for block in model.blocks for p in block.mlp.parameters())
    assert shape.tp_whole == moe and shape.tp_linears == 4 * 4  # q, k, v and proj of 4 blocks
    profile = Profile("gpt-moe", shape.parameters, shape.in_blocks, 0, 0, 0.0, 64, None, "adamw", 0.0, 0.0, 0.0)
    profile.tp_whole_parameters = shape.tp_whole
    tp2 = Layout("tp", 2, tp=2)
    rest = shape.parameters - shape.in_blocks
    assert _rank_parameters(profile, tp2) == (shape.in_blocks - moe) / 2 + moe + rest
