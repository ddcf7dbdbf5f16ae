"""tp and fsdp+tp: the built-in gpt's layers split across processes, weights equal serial's.

The gpt of `testing.real_model` (vocabulary 64, 4 heads, width 32, 4 blocks)
is trained 5 SGD steps under `tp` (2 processes) and `fsdp+tp` (4: 2 shards
x 2 tensor-parallel ranks) and compared with serial by name; then the same
with clipping, with a plan given as the tp_plan option and with gradient
accumulation. Measured on 2 CPU cores with torch 2.14: at most 8e-9 from
serial, clipped or not.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchfleet import launch
from torchfleet.env import DistEnv
from torchfleet.errors import UsageError
from torchfleet.models.gpt import GPT, GPTConfig
from torchfleet.precision import Precision
from torchfleet.strategies import Runtime, class_for
from torchfleet.strategies.dims import ParallelDims
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategies.tensor_parallel import tp_plan_for
from torchfleet.testing.real_models import tp_job, train_real_model

# lr 0.5 with max_grad_norm 0.05: every step clips (serial's norms are 1.2 to 1.6), and the
# weights move far enough that a global norm counting a split gradient's shards wrongly shows
# (it did: FSDP2's _StridedShard is no Shard, 1.5e-6 from serial at lr 1e-2, 6e-5 here).
CLIPPED = {"model": "gpt", "lr": 0.5, "fleet_options": {"max_grad_norm": 0.05}}
MLP_ONLY = {"blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel()}
CASES = [
    {"model": "gpt"},
    CLIPPED,
    {"model": "gpt", "tp_plan": MLP_ONLY},
    {"model": "gpt", "fleet_options": {"grad_accum": 2}},
]


@functools.lru_cache(maxsize=None)
def _serial(index: int) -> dict:
    case = {k: v for k, v in CASES[index].items() if k != "tp_plan"}
    return train_real_model("serial", **case)


def _check(strategy: str, results: list, said: str | None) -> None:
    for index, got in enumerate(results):
        want = _serial(index)
        assert set(got) == set(want), f"keys differ: {sorted(set(got) ^ set(want))}"
        diff = max((want[k] - got[k]).abs().max().item() for k in want)
        assert diff < 1e-5, f"{strategy} {CASES[index]}: max weight difference {diff:.3g} from serial"
    assert said and "Sequential has none" in said and "tp_plan" in said


@pytest.mark.timeout(60)
def test_tp_on_two_processes_matches_serial():
    (results, said), (others, _) = launch(tp_job, nprocs=2, args=("tp", CASES))
    assert others == [None] * len(CASES)  # the full weights are gathered on rank 0
    _check("tp", results, said)


@pytest.mark.timeout(60)
def test_fsdp_tp_on_four_processes_matches_serial():
    results, said = launch(tp_job, nprocs=4, args=("fsdp+tp", CASES[:2]))[0]
    _check("fsdp+tp", results, said)


def test_degrees_mesh_layout_and_class():
    def degrees(preset, world, **given):
        d = ParallelDims.from_preset(preset, world, **given)
        return d.dp_replicate, d.dp_shard, d.pp, d.tp

    assert degrees("tp", 2) == (1, 1, 1, 2) and degrees("fsdp+tp", 4) == (1, 2, 1, 2)
    assert degrees("fsdp+tp", 8, tp=4) == (1, 2, 1, 4) and degrees("fsdp", 4, tp=2) == (1, 2, 1, 2)
    assert degrees("ddp", 4, tp=2) == (2, 1, 1, 2) and degrees("hsdp", 8, tp=2) == (2, 2, 1, 2)
    names = {(1, 1, 1, 2): "tp", (1, 2, 1, 2): "fsdp+tp", (2, 1, 1, 2): "ddp+tp", (2, 2, 1, 2): "hsdp+tp"}
    for (r, s, p, t), name in names.items():
        dims = ParallelDims(r, s, p, world_size=r * s * p * t, tp=t)
        assert dims.name == name and class_for(dims).__name__ == "SplitParameters"
    # tp innermost: a tensor-parallel group is neighbouring ranks, and it reads one share of the batch.
    dims = ParallelDims(1, 2, 1, world_size=4, tp=2)
    assert [dims.coords(rank)["tp"] for rank in range(4)] == [0, 1, 0, 1]
    assert [dims.dp_rank(rank) for rank in range(4)] == [0, 0, 1, 1] and dims.dp == 2


def test_refusals_are_one_sentence():
    with pytest.raises(UsageError, match=r"dp_replicate\(1\) \* dp_shard\(1\) \* pp\(1\) \* tp\(3\) != 4 processes"):
        ParallelDims.from_preset("tp", 4, tp=3)
    with pytest.raises(UsageError, match=r"dp_replicate\(1\) \* dp_shard\(1\) \* pp\(1\) \* tp\(2\) != 3 processes"):
        ParallelDims.from_preset("fsdp+tp", 3)
    with pytest.raises(
        UsageError,
        match=r"pp\(2\) \* tp\(2\): tensor parallelism inside pipeline stages is not"
        r" supported yet; drop --tp, or drop --pp",
    ):
        ParallelDims.from_preset("ddp", 8, pp=2, tp=2)
    with pytest.raises(UsageError, match="tp with --pp 2: tensor parallelism inside pipeline stages"):
        ParallelDims.from_preset("tp", 2, pp=2)  # not quietly a pipeline with tp(1)
    with pytest.raises(UsageError, match="fsdp[+]pipeline with --tp 2: tensor parallelism inside pipeline"):
        ParallelDims.from_preset("fsdp+pipeline", 8, tp=2)
    heads = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32))
    with pytest.raises(
        UsageError,
        match="over 3 processes would split this GPT's 4 attention heads unevenly"
        r" \(each rank needs whole heads\); choose a --tp that divides 4",
    ):
        tp_plan_for(heads, 3)
    assert len(tp_plan_for(heads, 2)[0]) == 6  # q, k, v, fc by columns; the two projections by rows
    with pytest.raises(UsageError, match="the tp_plan option names 'blocks.0.attn.qkv', which is not a module"):
        tp_plan_for(heads, 2, {"blocks.0.attn.qkv": ColwiseParallel()})
    with pytest.raises(UsageError, match="maps 'blocks.0.attn.q' to str, not a ParallelStyle"):
        tp_plan_for(heads, 2, {"blocks.0.attn.q": "colwise"})


def test_options_that_need_tp_or_forbid_it():
    cpu = torch.device("cpu")
    runtime = Runtime(DistEnv(world_size=2, local_world_size=2), cpu, Precision("fp32", cpu), None)
    fsdp, tp = ParallelDims(1, 2, 1, world_size=2), ParallelDims(1, 1, 1, world_size=2, tp=2)
    strategy = class_for(fsdp)
    with pytest.raises(UsageError, match="tp_plan applies where layers are split .*; fsdp has no tensor parallelism"):
        strategy(runtime, StrategyOptions.of({"tp_plan": MLP_ONLY}), dims=fsdp)
    with pytest.raises(UsageError, match=r"--sync-batchnorm with tp\(2\) is not supported: the ranks of a"):
        strategy(runtime, StrategyOptions.of({"sync_batchnorm": True}), dims=tp)
    assert strategy(runtime, StrategyOptions.of({"tp_plan": MLP_ONLY}), dims=tp).name == "tp"


def test_a_lora_layer_is_split_with_the_layer_it_adapts():
    """peft's LoRA Llama: the plan is found through peft's wrapping, each adapted layer's style goes to the
    layer it wraps, and its adapter's B (beside a column-wise layer) or A (beside a row-wise one) is split
    with it. (The weights equal serial's under tp and fsdp+tp: tests/strategies/test_zoo.py.)"""
    pytest.importorskip("peft", reason="peft (the dev extra) wraps the model in LoRA adapters")
    from torch.distributed.tensor.parallel import SequenceParallel

    from zoo import peft_llama

    model = peft_llama()
    plan, source = tp_plan_for(model, 2)
    prefix = "base_model.model.model.layers.*"
    assert isinstance(plan[f"{prefix}.self_attn.q_proj.base_layer"], ColwiseParallel)
    assert isinstance(plan[f"{prefix}.self_attn.q_proj.lora_B.*"], ColwiseParallel)
    assert isinstance(plan[f"{prefix}.self_attn.o_proj.base_layer"], RowwiseParallel)
    assert isinstance(plan[f"{prefix}.self_attn.o_proj.lora_A.*"], RowwiseParallel)
    assert not any(k.endswith("q_proj.lora_A.*") or k.endswith("o_proj.lora_B.*") for k in plan)  # kept whole
    assert f"{prefix}.self_attn.q_proj" not in plan  # the wrapper itself is no Linear torch could split
    with pytest.raises(UsageError, match="splits .*q_proj.*which carries an adapter, with SequenceParallel"):
        tp_plan_for(model, 2, given={f"{prefix}.self_attn.q_proj": SequenceParallel()})


def test_a_library_plan_style_tp_cannot_map_is_refused_by_name():
    """Every word of transformers' plans maps to a torch style or is refused in one sentence naming it; an
    experts module's parameter words are taken by its own style, and must be the split it makes."""
    from types import SimpleNamespace

    from torchfleet.strategies.tp_styles import ExpertsSplit, LatentKeyValue, SumGradients, library_styles

    config = SimpleNamespace(qk_rope_head_dim=8)
    plan = library_styles(
        {
            "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
            "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
            "embed_in": "embedding_rowwise",
            "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "layers.*.mlp.experts.down_proj": "rowwise",
            "layers.*.mlp.experts": "moe_tp_experts",
        },
        config,
        "Model",
    )
    assert sorted(plan) == [
        "embed_in",
        "layers.*.mlp.experts",
        "layers.*.self_attn.kv_a_proj_with_mqa",
        "layers.*.self_attn.q_norm",
    ]
    assert isinstance(plan["layers.*.self_attn.q_norm"], SumGradients)
    assert isinstance(plan["layers.*.mlp.experts"], ExpertsSplit) and isinstance(plan["embed_in"], RowwiseParallel)
    assert plan["layers.*.self_attn.kv_a_proj_with_mqa"].rope_dim == 8  # type: ignore[attr-defined]
    assert isinstance(plan["layers.*.self_attn.kv_a_proj_with_mqa"], LatentKeyValue)
    refusals = [
        ({"layers.*.feed_forward.experts.gate_up_proj": "packed_rowwise"}, "with 'packed_rowwise' (an expert layout"),
        ({"layers.*.self_attn": "local_params"}, "'local_params' (attention sinks"),
        ({"layers.*.mlp.gate_up_proj": "packed_colwise"}, "'packed_colwise' outside an experts module"),
        ({"layers.*.mlp.experts": "moe_tp_experts"}, "moe_tp_experts without layers.*.mlp.experts.gate_up_proj"),
        ({"x": "warp"}, "with 'warp' (a style torchfleet does not know)"),
    ]
    for declared, words in refusals:
        with pytest.raises(UsageError, match=re.escape(words)) as info:
            library_styles(declared, config, "Llama4ForCausalLM")
        assert "\n" not in str(info.value) and str(info.value).startswith("Llama4ForCausalLM's base_model_tp_plan")
