"""plan and expert parallelism: ep and fsdp+ep rows for a model with experts only, the experts' state split
over ep, the all-to-alls in the communication, and fsdp+ep among the at-scale layouts of Mixtral 8x7B."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers import assert_refused_in_one_sentence, forked_torchfleet, require_module

require_module("transformers", "transformers (the test extra) builds the Mixtral models from configs")

from small_moe import EXPERTS, HIDDEN, LAYERS, SEQ, TOP_K  # noqa: E402 (after the skip)
from torchfleet.plan import comm, experts, nccl, predict, probe, profiler, run  # noqa: E402
from torchfleet.plan.config import PlanConfig  # noqa: E402
from torchfleet.plan.hardware import Target  # noqa: E402
from torchfleet.plan.layouts import layout  # noqa: E402
from torchfleet.plan.profile import StepFit  # noqa: E402

MIXTRAL = "tests/small_moe.py:mixtral"
SPEC = {"gpt_preset": "tiny", "image_size": 224, "seed": 0, "precision": "fp32"}
LINK = comm.Link(1e9, 0.0)  # no latency: the sums below are exact
GPUS = Target("t", 1, 8, 1e12, LINK, LINK, rate=1e12)


@pytest.fixture(scope="module")
def mixtral():
    return profiler.measure({**SPEC, "model": MIXTRAL}, "adamw", cores=1, timed=False)


@pytest.fixture(scope="module")
def mlp():
    return profiler.measure({**SPEC, "model": "mlp"}, "adamw", cores=1, timed=False)


def test_the_profile_finds_the_experts_and_the_rows_routed_to_them(mixtral, mlp):
    # 4 experts a layer in 2 layers, each stacking gate_up [4, 64 x 2, 32] and down [4, 32, 64]
    assert (mixtral.experts, mixtral.expert_layers) == (EXPERTS, LAYERS)
    assert mixtral.expert_parameters == LAYERS * EXPERTS * 3 * 64 * HIDDEN
    # each token sends k rows of the hidden width (fp32) to its experts, in every layer
    assert mixtral.routed_bytes_per_sample == SEQ * TOP_K * HIDDEN * 4 * LAYERS
    assert (mlp.experts, mlp.expert_parameters, mlp.routed_bytes_per_sample) == (0, 0, 0.0)


@pytest.mark.parametrize("here", [True, False], ids=["this-machine", "described-cluster"])
def test_ep_rows_only_for_a_model_with_experts(mixtral, mlp, here):
    target = (
        Target("here", 1, 4, 1e12, LINK, LINK, here=True)
        if here
        else Target("cluster", 1, 4, 1e12, LINK, LINK, rate=1e12)
    )
    cfg = PlanConfig(model="mlp", nproc=(2, 4))
    planned = {name for name, _ in run.candidates(cfg, target, mlp, 2)}
    assert {"ddp", "fsdp"} <= planned and not planned & {"ep", "fsdp+ep"}
    cfg = PlanConfig(model=MIXTRAL, nproc=(2, 4))
    pairs = set(run.candidates(cfg, target, mixtral, 2))
    assert {("ep", 2), ("ep", 4), ("fsdp+ep", 2), ("fsdp+ep", 4)} <= pairs


def test_the_experts_state_is_split_over_ep_and_the_rest_held_as_ddp_or_fsdp(mixtral):
    params, in_experts = mixtral.parameters, mixtral.expert_parameters
    rest = 16 * (params - in_experts)  # fp32 weights, gradients and AdamW's two moments
    state = {}
    for n in (2, 4):
        lay = layout("ep", n, 16, mixtral)
        assert (lay.replicate, lay.shard, lay.ep, lay.degrees()) == (n, 1, n, f"rep{n}, ep{n}")
        memory = predict.memory(mixtral, lay, 16)
        state[n] = memory["experts"]
        assert state[n] == pytest.approx(16 * in_experts / n)
        assert memory["training_state"] == pytest.approx(rest + state[n])
        assert memory["buffers"] == 0  # FSDP2 replicates the rest: no DDP buckets
    assert state[4] == pytest.approx(state[2] / 2)
    # fsdp+ep: ep 2 of the 4 shards, the experts sharded over the other 2: 1/4 of everything, as fsdp's
    lay = layout("fsdp+ep", 4, 16, mixtral)
    assert (lay.shard, lay.ep, lay.degrees()) == (4, 2, "shard4, ep2")
    memory = predict.memory(mixtral, lay, 16)
    assert memory["training_state"] == pytest.approx(16 * params / 4)
    assert memory["experts"] == pytest.approx(16 * in_experts / 4)
    fsdp = predict.memory(mixtral, layout("fsdp", 4, 16, mixtral), 16)
    assert memory["training_state"] == pytest.approx(fsdp["training_state"])
    # a block's gathered experts are its ep rank's half: the largest unit less half a layer's experts
    half_layer = in_experts / LAYERS / 2
    assert fsdp["buffers"] - memory["buffers"] == pytest.approx(8 * half_layer)


def _all_to_alls(profile, local: float, ep: int) -> float:
    """A step's all-to-alls by hand: 4 of each layer's rows and one of its counts, (ep - 1) / ep of each sent."""
    rows = local * profile.routed_bytes_per_sample / profile.expert_layers
    share = (ep - 1) / ep
    return profile.expert_layers * (4 * share * rows + share * profile.experts * 8) / LINK.bandwidth


def test_the_all_to_alls_are_in_the_ep_rows_communication(mixtral):
    params, in_experts = mixtral.parameters, mixtral.expert_parameters
    for batch in (16, 32):  # doubling the tokens a step doubles the rows sent
        ep = predict.step_time(mixtral, layout("ep", 4, batch, mixtral), batch, GPUS, 1, None)
        # the rest's gradients averaged over the 4 replicas; each replica's experts are its own
        averaged = comm.all_reduce_s(4 * (params - in_experts), 4, LINK)
        assert ep["communication"] == pytest.approx(averaged + _all_to_alls(mixtral, batch / 4, 4), rel=1e-9)
        fsdp_ep = predict.step_time(mixtral, layout("fsdp+ep", 4, batch, mixtral), batch, GPUS, 1, None)
        # the rest gathered twice and scattered over 4; each rank's 2 of 4 experts over the other ep group
        sharded = 3 * (
            comm.all_gather_s(4 * (params - in_experts), 4, LINK) + comm.all_gather_s(4 * in_experts / 2, 2, LINK)
        )
        assert fsdp_ep["communication"] == pytest.approx(sharded + _all_to_alls(mixtral, batch / 4, 2), rel=1e-9)
    # without routed rows (a mutation of the profile) only the averaged gradients are left
    silent = replace(mixtral, routed_bytes_per_sample=0.0, experts=0)
    alone = predict.step_time(silent, layout("ep", 4, 16, silent), 16, GPUS, 1, None)
    assert alone["communication"] == pytest.approx(comm.all_reduce_s(4 * (params - in_experts), 4, LINK))


def test_this_machine_sends_the_all_to_alls_over_its_probed_send_link(mixtral):
    """Here the rows go by Gloo's pairwise sends: the probe's send link, not the collectives' ring."""
    slow_sends = comm.Link(1e8, 0.0)
    calib = probe.Calibration("h", "t", 2, {1: 1e9}, {2: LINK}, {2: slow_sends}, {})
    here = Target("here", 1, 2, 1e12, LINK, LINK, cores_per_node=0, here=True)
    timed = replace(mixtral, time={1: StepFit(0.01, 0.001)})
    times = predict.step_time(timed, layout("ep", 2, 16, timed), 16, here, 1, calib)
    averaged = comm.all_reduce_s(4 * (timed.parameters - timed.expert_parameters), 2, LINK)
    sent = experts.step_all_to_all_s(8 * timed.routed_bytes_per_sample, EXPERTS, LAYERS, 2, slow_sends)
    assert times["communication"] == pytest.approx(averaged + sent, rel=1e-9)


def test_ep_on_a_model_without_experts_is_left_out_in_one_sentence():
    result = forked_torchfleet(
        "plan", "--model", "mlp", "--strategies", "ep", "--gpu", "A100", "--gpus-per-node", "4", timeout=120
    )
    assert_refused_in_one_sentence(result, "ep on 2 processes left out: mlp has no experts to split")
    result = forked_torchfleet("plan", "--model", "mlp", "--ep-dispatch", "deepep", timeout=120)
    assert_refused_in_one_sentence(result, "--ep-dispatch deepep prices fsdp+ep's rows at scale: give --hf-config")
    dense = ("--hf-config", "llama-3.1-8b", "--gpu", "H100", "--gpus-per-node", "8", "--precision", "bf16")
    result = forked_torchfleet("plan", *dense, "--ep-dispatch", "deepep", timeout=120)
    assert_refused_in_one_sentence(
        result, "--ep-dispatch deepep plans how fsdp+ep's tokens reach their experts, and llama"
    )


@pytest.mark.timeout(300)
def test_mixtral_at_scale_plans_fsdp_ep_over_a_nodes_gpus(tmp_path):
    """Two nodes of 8 H100s: fsdp+ep with ep 8 by default (Mixtral's 8 experts on one node's NVLink). Its sharded
    state is FSDP's; a block gathers its GPU's one expert, not 8; FSDP's collectives move the rest over the 16
    GPUs and each GPU's experts over its 2-GPU group; the all-to-alls cost 4 a layer over NVLink."""
    out = tmp_path / "plan.json"
    result = forked_torchfleet(
        "plan",
        "--hf-config",
        "mixtral-8x7b",
        "--gpu",
        "H100",
        "--gpus-per-node",
        "8",
        "--nodes",
        "2",
        "--nproc",
        "16",
        "--link",
        "400",
        "--json-out",
        str(out),
        timeout=280,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    rows = {r["layout"]: r for r in doc["rows"]}
    assert {"FSDP 16", "FSDP 16 + EP 8"} <= set(rows)
    fsdp, ep = rows["FSDP 16"], rows["FSDP 16 + EP 8"]
    assert ep["ep"] == 8 and ep["global_batch"] == fsdp["global_batch"] == 32
    assert ep["memory"]["optimizer"] == pytest.approx(fsdp["memory"]["optimizer"])
    assert ep["peak"] < fsdp["peak"] and ep["peak"] == pytest.approx(sum(ep["memory"].values()))
    # one all-to-all: 2 x 8192 tokens x 2 experts x 4096 wide in bf16, 7/8 of it over NVLink (450 GB/s, 20 us)
    routed = 2 * 8192 * 2 * 4096 * 2
    one = 7 / 8 * routed / 450e9 + 7 * 20e-6
    counts = 7 / 8 * 8 * 8 / 450e9 + 7 * 20e-6
    assert ep["time"]["ep"] == pytest.approx(32 * (4 * one + counts), rel=1e-9)
    # FSDP: gathered in bf16 for forward and backward, fp32 gradients scattered, a call per unit as NCCL runs it,
    # over --link (400 Gbit/s) as the 16 GPUs and the 2-GPU groups both span the 2 nodes: the rest in its 32 blocks
    # and the root (embedding, norm, output layer), each layer's experts a unit of their own.
    params = doc["parameters"]
    in_experts = 32 * 8 * 3 * 4096 * 14336
    root = 2 * 32000 * 4096 + 4096
    rest = params - in_experts

    def unit(count, ranks):
        gather = nccl.collective_s("all_gather", 2 * count, ranks, 2, 50e9, "nvlink")[0]
        return 2 * gather + nccl.collective_s("reduce_scatter", 4 * count, ranks, 2, 50e9, "nvlink")[0]

    wire = 32 * unit((rest - root) / 32, 16) + unit(root, 16) + 32 * unit(in_experts / 8 / 32, 2)
    assert ep["time"]["fsdp"] == pytest.approx(wire, rel=1e-6)
    # All of FSDP's collectives but a block's share hide behind the compute, which runs 18.9% slower for each
    # second hidden (plan/overlap.py); the all-to-alls hide nothing.
    t = ep["time"]
    assert t["overlap"] == pytest.approx(0.189 * (t["fsdp"] - t["fsdp"] / 32))
    assert t["step"] == pytest.approx(t["compute"] + t["fsdp"] / 32 + t["overlap"] + t["ep"])
    assert ep["time"]["fsdp"] < fsdp["time"]["fsdp"] / 5  # an eighth of the experts' bytes, most of the model
    # So are FSDP2's copies into and out of its buffers, which the GPU's compute pays.
    assert ep["time"]["compute"] < fsdp["time"]["compute"] * 0.999


def test_an_ep_layout_copies_only_its_gpus_experts_into_fsdps_buffers():
    """The gathered kinds and FSDP2's copies of them (the trace's "gathering" bytes) keep the rest of a block and
    1 / ep of its experts; what the step holds and moves otherwise is FSDP's."""
    from torchfleet.plan.experts_at_scale import split_experts
    from torchfleet.plan.traced import Traced

    work = (("matmul", 1e9), ("memory", 300.0), ("gathering", 400.0))
    traced = Traced(2, 8, ({"UNSHARDED_PARAM": 100.0, "ACT": 50.0},), 1e9, (), 0.0, work)
    split = split_experts(traced, block_share=0.8, ep=4, buffers=10.0)
    kept = 1 - 0.8 * (1 - 1 / 4)
    assert dict(split.work) == pytest.approx({"matmul": 1e9, "memory": 300.0, "gathering": 400.0 * kept})
    assert split.kinds == pytest.approx({"UNSHARDED_PARAM": 100.0 * kept, "ACT": 50.0, "ALL_TO_ALL": 10.0})


def test_deepep_sends_a_token_once_to_each_gpu_holding_its_experts():
    """--ep-dispatch deepep: a row per token and GPU holding any of its k experts, in expectation over evenly
    spread routing (counted here over every choice of k experts), against a row per expert for all-to-alls.
    Planned end to end on a small Qwen3 mixture of experts, the all-to-alls' seconds shrink by that ratio."""
    import itertools
    import math

    from torchfleet.plan import at_scale
    from torchfleet.plan.experts_at_scale import rows_per_token

    for experts_, k, ep in ((8, 2, 4), (16, 4, 8), (12, 3, 2)):
        per_gpu = experts_ // ep
        choices = list(itertools.combinations(range(experts_), k))
        counted = sum(len({e // per_gpu for e in c}) for c in choices) / len(choices)
        assert rows_per_token(experts_, k, ep, "deepep") == pytest.approx(counted)
        assert rows_per_token(experts_, k, ep, "all-to-all") == k
    assert rows_per_token(128, 8, 8, "deepep") == pytest.approx(8 * (1 - math.comb(112, 8) / math.comb(128, 8)))
    assert 5.3 < rows_per_token(128, 8, 8, "deepep") < 5.4  # Qwen3-30B-A3B over 8 GPUs

    small = {
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "vocab_size": 1024,
        "max_position_embeddings": 512,
    }

    def ep_row(dispatch):
        cfg = PlanConfig(
            hf_config="qwen3-moe-small",
            library_fields=small,
            gpu="H100",
            gpus_per_node=8,
            nproc=(8,),
            seq_len=256,
            ep=(8,),
            tp=(1,),
            ep_dispatch=dispatch,
            precision="bf16",
        )
        doc = at_scale.plan_at_scale(at_scale.request_of(cfg), say=lambda *_: None)
        (row,) = [r for r in doc["rows"] if "EP" in r["layout"]]
        return row

    plain, deep = ep_row("all-to-all"), ep_row("deepep")
    # What differs is the rows' all-to-alls only: the counts' small ones and the compute stay.
    assert deep["time"]["compute"] == pytest.approx(plain["time"]["compute"])
    counts = 2 * (7 / 8 * 16 * 8 / 450e9 + 7 * 20e-6)  # a layer's counts, before its dispatch
    ratio = rows_per_token(16, 4, 8, "deepep") / 4
    rows_of = {r: t["time"]["ep"] - counts for r, t in (("plain", plain), ("deep", deep))}
    one_plain = 7 / 8 * 2 * 256 * 4 * 256 * 2 / 450e9 + 7 * 20e-6  # lb 2, seq 256, k 4, hidden 256, bf16
    assert rows_of["plain"] == pytest.approx(2 * 4 * one_plain, rel=1e-9)  # 2 layers, 4 all-to-alls each
    one_deep = 7 / 8 * 2 * 256 * 4 * ratio * 256 * 2 / 450e9 + 7 * 20e-6
    assert rows_of["deep"] == pytest.approx(2 * 4 * one_deep, rel=1e-9)
    assert deep["time"]["step"] < plain["time"]["step"]


def test_an_fp32_plan_of_experts_run_as_one_grouped_product_is_refused_in_one_sentence(tmp_path):
    """transformers 5 runs a mixture's experts through torch._grouped_mm, which takes bf16 or fp16 only: an fp32
    plan at scale said so in a traceback; it says it in one sentence, and bf16 plans."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 loops over the experts, which fp32 traces")
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                **{"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "vocab_size": 512},
                **{"num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4},
                **{"num_experts_per_tok": 2, "max_position_embeddings": 256},
            }
        )
    )
    cluster = ("--hf-config", str(config), "--gpu", "H100", "--gpus-per-node", "4", "--seq-len", "64")
    result = forked_torchfleet("plan", *cluster, "--precision", "fp32", timeout=120)
    assert_refused_in_one_sentence(result, "--precision fp32 cannot trace mixtral's experts")
    out = tmp_path / "plan.json"
    result = forked_torchfleet("plan", *cluster, "--precision", "bf16", "--json-out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "FSDP 4 + EP 4" in {r["layout"] for r in json.loads(out.read_text())["rows"]}
