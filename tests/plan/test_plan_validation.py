"""The planner against published measured runs (plan/published.py): the summary that
docs/benchmarks/validation.md reports, recomputed, within the bounds it reaches.

Every run is planned as `torchfleet plan --hf-config` plans it, with its publisher's inputs and no figure
fitted to any run, so the leave-one-out error is the plain error. A change to the trace, a kernel rate, a
collective's cost or the memory model that moves the table past its bounds fails here; so does a wrong
matmul rate for one GPU kind (the second half).
"""

from __future__ import annotations

import dataclasses

import pytest

from helpers import require_module

require_module("transformers", "transformers (the test extra) builds the library models from configs")

# The bounds the table reaches (docs/benchmarks/validation.md), each rounded up to the next point: tokens/s 4.2%
# and 22.9% (10.2% and 24.5% before the compute that hidden collectives overlap was slowed, plan/overlap.py). The
# worst tokens/s is torchtitan's 70B on 256 H100s with async TP compiled without float8 (1.229), and the mixture
# of experts run on Transformer Engine's and DeepEP's kernels reads 0.81; the worst memory is torchtitan's 8B on
# 128 GPUs compiled, whose blocks' fusion the plan holds at 0.3 GiB less than eager where the run held 5 GiB less.
TOKENS_MEDIAN, TOKENS_WORST = 0.05, 0.23
MEMORY_MEDIAN, MEMORY_WORST = 0.04, 0.10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_published_runs_hold_the_tables_summary(monkeypatch):
    from torchfleet.plan import kernels, published

    rows = published.table()
    s = published.summary(rows)
    for r in rows:
        print(f"{r['run'].model} {r['run'].gpus} x {r['run'].gpu} {r['run'].inputs}: {r['tokens_ratio']:.2f}")
    print(s)
    assert s["runs"] >= 20 and s["sources"] >= 4 and s["gpu_kinds"] >= 3
    assert {r["run"].model for r in rows} >= {"bert-large", "qwen3-30b-a3b"}  # an encoder and a mixture of experts
    assert s["tokens_median"] <= TOKENS_MEDIAN and s["tokens_worst"] <= TOKENS_WORST
    assert s["memory_median"] <= MEMORY_MEDIAN and s["memory_worst"] <= MEMORY_WORST
    # Comparisons inside a source in the published order (the issue asks 90%): tokens/s 84 of 85 pairs; memory
    # 20 of 22, since a compiled step holds its fused chains' inputs (plan/compiled.py): the 2 missed are ties,
    # compiled with and without float8, which the plan holds alike (docs/benchmarks/validation.md).
    right, pairs = s["tokens_order"]
    assert pairs >= 80 and right / pairs >= 0.9
    right, pairs = s["memory_order"]
    assert pairs >= 20 and right / pairs >= 0.9

    # The A100's products priced at the H100's MAMF fraction instead of its own: its runs move off.
    a100 = tuple(r for r in published.RUNS if r.gpu == "A100" and r.model.startswith("mpt"))
    before = {r["run"]: r["tokens_ratio"] for r in rows if r["run"] in a100}
    slower = dataclasses.replace(kernels.KINDS["A100"], matmul=kernels.KINDS["H100"].matmul)
    monkeypatch.setitem(kernels.KINDS, "A100", slower)
    after = {r["run"]: r["tokens_ratio"] for r in published.table(a100)}
    for run in a100:
        assert after[run] < before[run] * 0.97, (run, before[run], after[run])


SMALL = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
}


def _cluster(gpu: str, **options):
    from torchfleet.plan import hardware

    return hardware.gpu_cluster(
        nodes=1,
        per_node=8,
        gpu=gpu,
        tflops=None,
        memory_gb=None,
        mfu=0.48,
        precision="bf16",
        intra_gbit=None,
        inter_gbit=None,
        by_operator=True,
        **options,
    )


def test_a_traced_step_is_priced_by_what_bounds_each_operator():
    """Every counted FLOP is a product's or attention's; each part runs at its own rate on the GPU planned;
    --compile drops the pointwise operators' reads, --float8 moves the products to the FP8 peak and adds
    their operands' casts, and a GPU without FP8 products refuses it in one sentence."""
    from torchfleet.errors import UsageError
    from torchfleet.plan import kernels, trace

    traced = trace.traced_at_scale(SMALL, trace.Workload(seq=128, local_batch=2), 2)
    work = dict(traced.work)
    assert work["matmul"] + work["attention"] == pytest.approx(traced.flops)
    assert work["matmul"] > work["attention"] > 0 and work["operands"] > 0
    assert 0 < work["pointwise_out"] < work["pointwise"] and work["memory"] > 0 and work["gathering"] > 0

    a100 = kernels.KINDS["A100"]
    by_hand = (
        work["matmul"] / (312e12 * 271.2 / 312)
        + work["attention"] / 2 / (312e12 * 0.6)
        + (work["memory"] + work["gathering"] + work["pointwise"]) / (2.039e12 * kernels.MEMORY_FRACTION)
    )
    eager = _cluster("A100").compute_s(traced.flops, traced.work)
    assert eager == pytest.approx(by_hand)
    compiled = _cluster("A100", compile=True).compute_s(traced.flops, traced.work)
    saved = (work["pointwise"] - work["pointwise_out"]) / (a100.bandwidth * kernels.MEMORY_FRACTION)
    assert eager - compiled == pytest.approx(saved)
    # A GPU of the table at its own rates, not at one fraction of its peak; a step without the split at that.
    assert eager != pytest.approx(traced.flops / (312e12 * 0.48))
    assert _cluster("A100").compute_s(traced.flops) == pytest.approx(traced.flops / (312e12 * 0.48))

    h100 = kernels.KINDS["H100"]
    bf16 = _cluster("H100").compute_s(traced.flops, traced.work)
    fp8 = _cluster("H100", float8=True).compute_s(traced.flops, traced.work)
    products = work["matmul"] / (h100.bf16 * h100.matmul) - work["matmul"] / (h100.fp8 * h100.matmul_fp8)
    casts = 1.5 * work["operands"] / (h100.bandwidth * kernels.MEMORY_FRACTION)
    assert bf16 - fp8 == pytest.approx(products - casts)
    with pytest.raises(UsageError, match="--float8 needs"):
        _cluster("A100", float8=True)
    # cuDNN's attention (--attention cudnn): the same FLOPs at its own measured fraction, on Hopper kinds only.
    cudnn = _cluster("H100", attention="cudnn").compute_s(traced.flops, traced.work)
    assert h100.attention_cudnn == pytest.approx(3.5 / (1 / 518 + 2.5 / 499) / 989.4)
    faster = work["attention"] / 2 / h100.bf16 * (1 / h100.attention - 1 / h100.attention_cudnn)
    assert bf16 - cudnn == pytest.approx(faster) and faster > 0
    with pytest.raises(UsageError, match="--attention cudnn is priced from measurements on Hopper GPUs"):
        _cluster("A100", attention="cudnn")
