"""plan --hf-config: a library model's step traced on fake tensors, carried to its depth and to any number of GPUs.

The figures are checked against what they stand for: a full-depth trace for
the carried one, a trace at another world for the sharding arithmetic, two
real gloo processes training the same model for the fake trace, and the
model's parameter count for the columns a layout shards.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers import assert_refused_in_one_sentence, forked_torchfleet, require_module

require_module("transformers", "transformers (the test extra) builds the library models from configs")

from torchfleet import launch  # noqa: E402 (after the skip)
from torchfleet.plan import (  # noqa: E402
    at_scale,
    flash_attention,
    library_model,
    nccl,
    pipeline_at_scale,
    pipelines,
    scale_rows,
    schedule_memory,
    tensor_parallel,
    trace,
)
from torchfleet.plan.step_counter import step_counter  # noqa: E402

# Its plans take 20-60 s alone and took over 60 s each in CI's two lanes side by side (30 Nov); a test's own mark,
# where it has one, stands.
pytestmark = pytest.mark.timeout(400)

# A Llama of Llama 3.1's architecture at a size this machine trains in a second: deeper than the traced
# depths (2, 4, 6), so its figures are carried, not traced whole.
SMALL = {
    **library_model.read_config("llama-3.1-8b"),
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "num_hidden_layers": 8,
    "bos_token_id": None,
    "eos_token_id": None,
}
WORK = {"seq": 64, "local_batch": 2}
# Llama 3.1 8B's FSDP units: 32 blocks of 218,112,000 parameters, and the root (the embedding and the output
# layer, 128,256 x 4,096 each, and the final norm).
LLAMA_8B_ROOT = 2 * 128_256 * 4096 + 4096
LLAMA_8B_UNITS = ((32, (8_030_261_248 - LLAMA_8B_ROOT) / 32), (1, LLAMA_8B_ROOT))


def _fsdp_wire(params: float, units, ranks: int, nodes: int, bandwidth: float) -> float:
    """FSDP's three passes, a call per unit as NCCL runs it: gathered in bf16 for forward and backward, fp32
    gradients reduce-scattered."""
    assert sum(calls * count for calls, count in units) == pytest.approx(params)

    def call(kind, nbytes):
        return nccl.collective_s(kind, nbytes, ranks, nodes, bandwidth, "nvlink")[0]

    return sum(
        calls * (2 * call("all_gather", 2 * count) + call("reduce_scatter", 4 * count)) for calls, count in units
    )


# The same with a vocabulary wide beside the rest, as Llama 3.1's 128,256 are beside its width: the whole
# vocabulary's logits, which no tensor-parallel rank holds, outweigh the model's other tensors.
WIDE_VOCAB = {**SMALL, "vocab_size": 4096}


@pytest.mark.parametrize("ac", ["none", "full"])  # with full, the peak moves between depths 2 and 4 (8B's shapes)
def test_a_deep_model_carried_from_shallow_traces_equals_its_whole_trace(ac):
    work = trace.Workload(**WORK, ac=ac)
    carried = trace.traced_at_scale(SMALL, work, trace.TRACE_WORLD)
    whole = trace.trace(SMALL, work, trace.TRACE_WORLD)
    assert whole.layers == 8 and carried.layers == 8
    assert carried.peak == pytest.approx(whole.peak, rel=1e-3), (carried.kinds, whole.kinds)
    assert carried.flops == pytest.approx(whole.flops, rel=1e-9) and whole.flops > 0


@pytest.mark.parametrize("world", [2, 32])
def test_another_world_reads_the_same_trace_as_a_trace_at_that_world(world):
    work = trace.Workload(**WORK, ac="selective")
    read = trace.trace(SMALL, work, trace.TRACE_WORLD, layers=2).at_world(world)
    traced = trace.trace(SMALL, work, world, layers=2)
    # FSDP2 pads each shard to whole elements: a few hundred bytes in a peak of megabytes.
    assert read.peak == pytest.approx(traced.peak, rel=2e-3), (read.kinds, traced.kinds)


def _real_peaks(fields: dict, tp: int = 1) -> dict | None:
    """In each of 2 gloo processes: the small model trained for real under the traced layout (FSDP over both,
    or tensor parallel over both) in each checkpointing mode; the main rank returns each mode's tensor peak,
    FLOPs and tensor-parallel collectives."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")  # launch sets the rendezvous's environment, as torchrun does
    world = dist.get_world_size()
    mesh = (
        init_device_mesh("cpu", (world,))
        if tp == 1
        else init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    )
    measured = {}
    for ac in trace.AC_MODES:
        torch.manual_seed(0)
        # DTensor's shape propagation makes whole-shaped fake tensors in real runs too: no memory, kept from
        # the tracker here as in the trace (tensor_parallel.traceable).
        with tensor_parallel.traceable():
            tracker, counter = trace.tracked_step(fields, trace.Workload(**WORK, ac=ac, tp=tp), mesh, FSDPMemTracker)
        peak = sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
        measured[ac] = {
            "peak": peak,
            "flops": counter.total,
            "collectives": counter.collectives,
            "calls": counter.calls,
        }
    rank = dist.get_rank()
    dist.destroy_process_group()
    return measured if rank == 0 else None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fake_trace_predicts_the_tensor_peak_of_real_processes_within_10_percent():
    """Fake tensors and a fake process group of 8, carried to 8 blocks and read at 2 ranks, against 2 real gloo
    processes training the model: every checkpointing mode within the 10% the issue asks (the H200 run put the
    tracker itself within 0.1% of max_memory_allocated). Measured on torch 2.14.1, with attention as a fused
    kernel holds it (plan/flash_attention.py) on both sides: none, selective and full within 0.1%."""
    real = launch(_real_peaks, nprocs=2, args=(SMALL,))[0]
    for ac in trace.AC_MODES:
        predicted = trace.traced_at_scale(SMALL, trace.Workload(**WORK, ac=ac), 2).peak
        measured = real[ac]["peak"]
        print(f"{ac}: predicted {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")
        assert measured > 0 and abs(predicted / measured - 1) <= 0.10, (ac, predicted, measured)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_tensor_parallel_trace_predicts_real_tensor_parallel_processes():
    """The same check for torchtitan's tensor-parallel layout (sequence parallel, split vocabulary, loss on the
    split logits) over 2 real gloo processes: the fake trace at 8 FSDP ranks x tp 2, carried to 8 blocks and read
    at 1, against the real step's tensor peak within 10%, and its FLOPs and collective bytes exactly. The wide
    vocabulary makes the whole logits, which no rank holds, half the peak: on torch 2.11 the trace once counted
    them (selective +10.1%). Measured on torch 2.14.1: none, selective and full within 0.1%."""
    real = launch(_real_peaks, nprocs=2, args=(WIDE_VOCAB, 2))[0]
    for ac in trace.AC_MODES:
        traced = trace.traced_at_scale(WIDE_VOCAB, trace.Workload(**WORK, ac=ac, tp=2), 1)
        measured = real[ac]
        print(f"{ac}: predicted {traced.peak / 2**20:.2f} MiB, measured {measured['peak'] / 2**20:.2f} MiB")
        assert measured["peak"] > 0 and abs(traced.peak / measured["peak"] - 1) <= 0.10, (ac, traced, measured)
        assert traced.flops == pytest.approx(measured["flops"], rel=1e-9)
        assert {kind: nbytes for kind, nbytes, _ in traced.collectives} == pytest.approx(measured["collectives"])
        assert {kind: calls for kind, _, calls in traced.collectives} == pytest.approx(measured["calls"])
    # Without checkpointing each block gathers its sequence-parallel input twice (before attention and before
    # the feed-forward) and reduce-scatters their outputs, and backward does the reverse: 4 of each a block, of
    # the whole activation (batch x sequence x width in bf16), plus the embedding's and the output layer's one.
    activation = WORK["local_batch"] * WORK["seq"] * SMALL["hidden_size"] * 2
    blocks = WIDE_VOCAB["num_hidden_layers"]
    assert real["none"]["collectives"]["all_gather"] == (4 * blocks + 2) * activation
    assert real["none"]["collectives"]["reduce_scatter"] == (4 * blocks + 2) * activation


def _real_stage_peaks(fields: dict, microbatches: int) -> dict | None:
    """In each of 2 gloo processes, one stage of a real 2-stage 1F1B pipeline of the small model (the first with
    the embedding, the last with the output layer), FSDP2 over each stage's one rank as the plan lays it out,
    activations and gradients sent between the processes; per checkpointing mode, each stage's tensor peak."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    role = "first" if rank == 0 else "last"
    mesh = init_device_mesh("cpu", (pp, 1), mesh_dim_names=("pp", "dp_shard"))["dp_shard"]
    stage_fields = {**fields, "num_hidden_layers": fields["num_hidden_layers"] // pp}
    # 1F1B: p - rank forwards to warm up, then one backward and one forward in turn, then the rest's backwards.
    warm = min(microbatches, pp - rank)
    order = ["F"] * warm + ["B", "F"] * (microbatches - warm) + ["B"] * warm
    peaks = {}
    for ac in trace.AC_MODES:
        torch.manual_seed(0)
        work = trace.Workload(seq=WORK["seq"], local_batch=1, ac=ac, reshard_after_forward=False, stage=role)
        model = library_model.build(stage_fields)
        flash_attention.use(model)  # the attention the plan traces, a GPU's fused kernel's
        library_model.keep_stage(model, role)
        trace._prepare(model, stage_fields, work, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        trace._make_optimizer_state(model, optimizer)
        tokens = torch.randint(0, fields["vocab_size"], (microbatches, 1, WORK["seq"] + 1))
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        held, sends, done = [], [], 0
        with tracker:
            for i, step in enumerate(order):
                if step == "F":
                    tracker.reset_mod_stats()  # it refuses a root module called twice a step; its peak stays
                    f = order[:i].count("F")
                    if role == "first":
                        out = model(input_ids=tokens[f][:, :-1], use_cache=False).logits
                        sends.append(dist.isend(out.detach().contiguous(), dst=rank + 1))
                        held.append((None, out))
                    else:
                        x = torch.empty(1, WORK["seq"], fields["hidden_size"], dtype=torch.bfloat16)
                        dist.recv(x, src=rank - 1)
                        out = model(inputs_embeds=x.requires_grad_(), use_cache=False).logits
                        held.append((x, F.cross_entropy(out.flatten(0, 1).float(), tokens[f][:, 1:].flatten())))
                    continue
                x, out = held.pop(0)
                done += 1
                final = done == microbatches  # as torch's PipelineStage drives FSDP2: accumulate until the last
                model.set_is_last_backward(final)
                model.set_reshard_after_backward(final)
                model.set_requires_gradient_sync(final)
                if role == "first":
                    grad = torch.empty(out.shape, dtype=out.dtype)
                    dist.recv(grad, src=rank + 1)
                    out.backward(grad)
                else:
                    out.backward()
                    sends.append(dist.isend(x.grad.contiguous(), dst=rank - 1))
            for send in sends:
                send.wait()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks[ac] = sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
    gathered = [None] * pp
    dist.all_gather_object(gathered, peaks)
    dist.destroy_process_group()
    return dict(zip(("first", "last"), gathered, strict=True)) if rank == 0 else None


ROLES = (("first", 0), ("last", 1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pipeline_stage_holds_what_the_plan_traces_within_10_percent():
    """A real 2-stage 1F1B pipeline of 4 micro-batches in 2 gloo processes against the plan's stages: the first
    (the embedding, 2 micro-batches held) and the last (the output layer, 1 held), each with the gradients it
    accumulates, within 10% in every checkpointing mode. Measured on torch 2.14.1: first +0.8%, +4.9%, +7.5%;
    last +0.3%, +2.8%, +7.4% (none, selective, full). GPipe, which plan runs only when asked (--schedule),
    is over-predicted by 11% to 23% at this size."""
    import torch

    if torch.__version__.startswith("2.11."):
        pytest.skip(
            "torch 2.11's AdamW on fake tensors holds its step's temporaries at the end of the step: at"
            " this toy size that moment is the first stage's peak, 57% above the real one"
        )
    m = 4
    real = launch(_real_stage_peaks, nprocs=2, args=(SMALL, m))[0]
    params = library_model.parameter_count(SMALL)
    stage_fields = {**SMALL, "num_hidden_layers": SMALL["num_hidden_layers"] // 2}
    held = {role: schedule_memory.peak("1f1b", 2, m, 1, rank, 1.0, 0.0).microbatches for role, rank in ROLES}
    assert held == {"first": 2, "last": 1}
    for ac in trace.AC_MODES:
        kept = trace.Workload(seq=WORK["seq"], local_batch=1, ac=ac, reshard_after_forward=False)
        for role in ("first", "last"):
            parameters = pipeline_at_scale.stage_parameters(SMALL, params, 2, role)
            _, memory = pipeline_at_scale._stage(stage_fields, kept, 1, role, parameters, ("1f1b", 2, m, 1))
            predicted, measured = sum(memory.values()), real[role][ac]
            print(f"{ac} {role}: predicted {predicted / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB")
            assert measured > 0 and abs(predicted / measured - 1) <= 0.10, (ac, role, predicted, measured)


def test_a_shipped_config_plans_its_columns_from_its_parameter_count(tmp_path):
    out = tmp_path / "plan.json"
    result = forked_torchfleet(
        "plan",
        "--hf-config",
        "llama-3.1-8b",
        "--gpu",
        "H100",
        "--gpus-per-node",
        "8",
        "--nodes",
        "16",
        "--nproc",
        "8,128",
        "--link",
        "400",
        "--tp",
        "1",
        "--mfu",
        str(at_scale.AT_SCALE_EFFICIENCY),  # one rate for every FLOP (plan/kernels.py prices them by operator)
        "--json-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    params = doc["parameters"]
    assert params == 8_030_261_248  # Llama 3.1 8B's published count
    rows = {r["gpus"]: r for r in doc["rows"] if r["dp_replicate"] == 1}
    for gpus, row in rows.items():
        # AdamW's two fp32 moments, sharded over the GPUs; one rank's shard of each parameter rounds up.
        assert row["memory"]["optimizer"] == pytest.approx(8 * params / gpus, rel=1e-3)
        assert row["peak"] == pytest.approx(sum(row["memory"].values()))
        assert row["reserved"] == pytest.approx(row["peak"] * scale_rows.RESERVED_OVER_ALLOCATED)
        assert row["fits"] == (row["peak"] <= 80e9) and row["tight"] == (row["peak"] <= 80e9 < row["reserved"])
    # Everything but the sharded state is the same on 8 and 128 GPUs: the difference is 15/16 of the
    # shards' bytes at 8 (fp32 weights and AdamW moments; no gradient is held at this step's peak).
    shards_at_8 = rows[8]["memory"]["optimizer"] + 4 * params / 8
    assert rows[8]["peak"] - rows[128]["peak"] == pytest.approx(shards_at_8 * 15 / 16, rel=1e-3)
    # The step: the traced FLOPs at 48% of the H100's 989.4 TFLOP/s; three passes over the parameters (gathered
    # in bf16 for forward and for backward, fp32 gradients scattered: 8 bytes a parameter), a call per FSDP unit
    # (32 blocks and the root) as NCCL runs it, over NVLink (450 GB/s) within a machine and --link 400 Gbit/s
    # (50 GB/s) across its 16 machines.
    for gpus, bandwidth, nodes in ((8, 450e9, 1), (128, 50e9, 16)):
        t = rows[gpus]["time"]
        assert t["compute"] == pytest.approx(rows[gpus]["flops"] / (989.4e12 * at_scale.AT_SCALE_EFFICIENCY))
        wire = _fsdp_wire(params, LLAMA_8B_UNITS, gpus, nodes, bandwidth)
        assert t["communication"] == pytest.approx(wire, rel=1e-6)
        # Hidden but one block's share; the compute it hides behind runs 18.9% slower for it (plan/overlap.py).
        assert t["overlap"] == pytest.approx(0.189 * t["communication"] * 31 / 32)
        assert t["step"] == pytest.approx(t["compute"] + t["communication"] / 32 + t["overlap"])
        assert rows[gpus]["tokens_per_s_per_gpu"] == pytest.approx(2 * 8192 / t["step"])
    # 8B on 8 H100s: 70.3 GiB of tensors fit 74.5 GiB, and 79.8 reserved do not; 128 GPUs hold it with room.
    assert rows[8]["tight"] and rows[128]["fits"] and not rows[128]["tight"]
    assert "FSDP 128 over 128 H100 GPUs is the fewest that hold the step" in doc["recommendation"]
    assert "on 128 H100 GPUs the fastest layout that fits is FSDP 128: 6,466 tokens/s a GPU" in doc["recommendation"]


def test_tensor_parallel_and_hsdp_layouts_cost_their_collectives_on_the_links_they_cross(tmp_path):
    """On two machines of 8 H100s (--link 400): tp 8 on 8B does an eighth of FSDP's FLOPs a GPU, every traced
    collective costs a ring over NVLink and is not hidden, and FSDP shards what tp left over the 2 machines;
    HSDP shards within each machine and all-reduces the shards' gradients between them. The recommendation
    is the fastest layout that fits 16 GPUs."""
    out = tmp_path / "plan.json"
    result = forked_torchfleet(
        "plan",
        "--hf-config",
        "llama-3.1-8b",
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
        "--tp",
        "1,8",
        "--json-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    rows = {r["layout"]: r for r in doc["rows"]}
    assert set(rows) == {"FSDP 16", "HSDP 2 x 8", "FSDP 2 x TP 8"}  # tp 8 leaves no node to shard within
    fsdp, tp, hsdp = rows["FSDP 16"], rows["FSDP 2 x TP 8"], rows["HSDP 2 x 8"]
    assert (tp["layout"], tp["dp_shard"], tp["global_batch"]) == ("FSDP 2 x TP 8", 2, 4)
    assert tp["flops"] == pytest.approx(fsdp["flops"] / 8, rel=0.02)
    # AdamW's moments: every parameter's shard is 1/16 in both layouts.
    assert tp["memory"]["optimizer"] == pytest.approx(fsdp["memory"]["optimizer"], rel=1e-3)
    t = tp["time"]
    # Each call among the 8 GPUs of a node over NVLink (450 GB/s), as NCCL runs it.
    expected = sum(
        c["calls"] * nccl.collective_s(kind, c["bytes"] / c["calls"], 8, 1, 450e9, "nvlink")[0]
        for kind, c in tp["collectives"].items()
    )
    assert t["tp"] == pytest.approx(expected, rel=1e-6)
    # One bf16 activation of batch 2 x 8192 x 4096 is 128 MiB; selective checkpointing gathers it 6 times a block
    # (twice in forward, again when recomputing, and twice as backward's reduce-scatters' reverse).
    assert tp["collectives"]["all_gather"]["bytes"] == pytest.approx(6 * 32 * 2 * 8192 * 4096 * 2, rel=0.02)
    params = doc["parameters"]
    wire = _fsdp_wire(params / 8, tuple((calls, count / 8) for calls, count in LLAMA_8B_UNITS), 2, 2, 50e9)
    assert t["fsdp"] == pytest.approx(wire, rel=1e-6)
    assert t["overlap"] == pytest.approx(0.189 * t["fsdp"] * 31 / 32)  # tp's collectives hide nothing
    assert t["step"] == pytest.approx(t["compute"] + t["fsdp"] / 32 + t["overlap"] + t["tp"])
    assert tp["tokens_per_s_per_gpu"] == pytest.approx(2 * 8192 / 8 / t["step"])
    # HSDP: AdamW's moments shard over one machine's 8 GPUs, not 16; FSDP's three passes stay on NVLink, and
    # each unit's fp32 gradient shards (an eighth of it) are all-reduced by 2 replicas over --link.
    assert hsdp["memory"]["optimizer"] == pytest.approx(8 * params / 8, rel=1e-3)
    within = _fsdp_wire(params, LLAMA_8B_UNITS, 8, 1, 450e9)
    across = sum(
        calls * nccl.collective_s("all_reduce", 4 * count / 8, 2, 2, 50e9, "nvlink")[0]
        for calls, count in LLAMA_8B_UNITS
    )
    assert hsdp["time"]["fsdp"] == pytest.approx(within + across, rel=1e-6)
    assert hsdp["global_batch"] == fsdp["global_batch"] == 32
    best = max((r for r in doc["rows"] if r["fits"] and not r["tight"]), key=lambda r: r["tokens_per_s_per_gpu"])
    assert f"the fastest layout that fits is {best['layout']}:" in doc["recommendation"]


def test_pipeline_layouts_add_their_bubble_held_micro_batches_and_accumulated_gradients(tmp_path):
    """pp 2 and 4 of the small Llama on 8 GPUs of one machine, 4 micro-batches of one sample: 1F1B idles
    (p-1)/m of its compute and holds p micro-batches on its first stage; interleaved 1F1B (2 stages a GPU)
    halves the idle slots and holds (1 + (p-1)/2p) times as many; every stage adds its share of the model's
    gradients, accumulated unsharded in fp32 over the micro-batches."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    out = tmp_path / "plan.json"
    result = forked_torchfleet(
        "plan",
        "--hf-config",
        str(config),
        "--gpu",
        "H100",
        "--gpus-per-node",
        "8",
        "--nproc",
        "8",
        "--tp",
        "1",
        "--pp",
        "2,4",
        "--local-batch",
        "4",
        "--seq-len",
        "64",
        "--json-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    rows = {(r.get("pp", 1), r.get("schedule")): r for r in doc["rows"]}
    assert set(rows) == {(1, None), (2, "1f1b"), (2, "interleaved-1f1b"), (4, "1f1b"), (4, "interleaved-1f1b")}
    params = doc["parameters"]
    for pp in (2, 4):
        plain, looped = rows[(pp, "1f1b")], rows[(pp, "interleaved-1f1b")]
        assert plain["layout"] == f"FSDP {8 // pp} x PP {pp} (1f1b)" and plain["microbatches"] == 4
        t = plain["time"]
        assert t["bubble"] == pytest.approx(t["compute"] * (pp - 1) / 4)
        assert looped["time"]["bubble"] == pytest.approx(t["compute"] * (pp - 1) / 8)
        assert t["step"] == pytest.approx(t["compute"] + t["bubble"] + t["exposed"])
        assert plain["tokens_per_s_per_gpu"] == pytest.approx(4 * 64 / pp / t["step"])
        assert plain["memory"]["gradients"] >= 4 * params / pp * 0.999
        # torch's orders of actions: at pp 2 interleaved 1F1B's second round of forwards starts before the
        # first's backwards end (2.5 micro-batches of the first GPU's blocks against 2); at pp 4 its first GPU runs
        # all 8 half-stage forwards first (4 against 4), and its backwards begin on its later stage, whose
        # gradients are reduce-scattered before the earlier stage's exist: half the stage's at once.
        peaks = {s: schedule_memory.peak(s, pp, 4, v, 0, 1.0, 1.0) for s, v in (("1f1b", 1), ("interleaved-1f1b", 2))}
        assert peaks["1f1b"] == schedule_memory.Peak(pp, 1.0)
        assert peaks["interleaved-1f1b"] == schedule_memory.Peak(*{2: (2.5, 1.0), 4: (4.0, 0.5)}[pp])
        assert plain["peak_stage"] == looped["peak_stage"] == "first"
        if pp == 2:
            assert looped["memory"]["activations"] > plain["memory"]["activations"]
            assert looped["memory"]["gradients"] == pytest.approx(plain["memory"]["gradients"])
        else:
            assert looped["memory"]["activations"] == pytest.approx(plain["memory"]["activations"])
            first_stage = pipeline_at_scale.stage_parameters(SMALL, params, pp, "first")
            assert plain["memory"]["gradients"] - looped["memory"]["gradients"] == pytest.approx(2 * first_stage)
    # The pace is the last GPU's: half the blocks and the output layer, for each of its micro-batches.
    assert rows[(2, "1f1b")]["flops"] < rows[(1, None)]["flops"] * 8 / 2
    # Each row says whose memory it gives: the first GPU's (the most micro-batches held) or the last's.
    assert {r["peak_stage"] for r in doc["rows"] if "pp" in r} <= {"first", "last"}
    # 1F1B's last GPU holds one micro-batch, GPipe's all, interleaved 1F1B's its warm-up of (v-1) p chunks and one
    # more, each 1/v of its layers: 2.5 at p 4, v 2, where the first holds (p v + p - 1) / v = 5.5.
    assert [pipelines.held_by_last(s, 4, 8, v) for s, v in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2))] == [
        1.0,
        8,
        2.5,
    ]
    assert pipelines.activations_held("interleaved-1f1b", 4, 8, 2) * 4 == 5.5


def test_a_pipelines_first_and_last_stages_hold_the_model_between_them():
    """pp 2 of the small Llama traced on 4 FSDP ranks: the first GPU's stage holds half the blocks and the
    embedding, the last's the other half, the final norm and the output layer. Their parameters add up to the
    whole model's, exactly, and so do their FLOPs; before, every stage was traced with both ends (an 8B stage
    at pp 2 counted about 2.4 blocks' worth of parameters twice)."""
    work = trace.Workload(seq=64, local_batch=1, reshard_after_forward=False)
    whole = trace.trace(SMALL, work, 4)
    half = {**SMALL, "num_hidden_layers": SMALL["num_hidden_layers"] // 2}
    first, last = (trace.trace(half, replace(work, stage=role), 4) for role in ("first", "last"))
    params = library_model.parameter_count(SMALL)
    width, vocab = SMALL["hidden_size"], SMALL["vocab_size"]
    in_blocks = params - 2 * vocab * width - width
    assert first.kinds["SHARDED_PARAM"] == 4 * (in_blocks / 2 + vocab * width) / 4  # fp32, a quarter a rank
    assert last.kinds["SHARDED_PARAM"] == 4 * (in_blocks / 2 + vocab * width + width) / 4
    assert first.kinds["SHARDED_PARAM"] + last.kinds["SHARDED_PARAM"] == whole.kinds["SHARDED_PARAM"]
    assert first.flops + last.flops == whole.flops and last.flops > first.flops  # the output layer's


def test_a_pipeline_whose_stages_span_nodes_also_comes_as_hsdp(tmp_path):
    """4 machines of 8 GPUs, pp 2: a stage's 16 GPUs span two machines, so besides FSDP 16 x PP 2 the plan
    has HSDP 2 x 8 x PP 2. Its stage is the one FSDP 8 x PP 2 traces on 16 GPUs (the states shard over one
    machine's 8), and its FSDP time is that row's plus the all-reduce of each GPU's fp32 gradient shard (its
    stage's half of the model, an eighth of it) between the 2 replicas over --link 400."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    out = tmp_path / "plan.json"
    result = forked_torchfleet(
        "plan",
        "--hf-config",
        str(config),
        "--gpu",
        "H100",
        "--gpus-per-node",
        "8",
        "--nodes",
        "4",
        "--nproc",
        "16,32",
        "--link",
        "400",
        "--tp",
        "1",
        "--pp",
        "2",
        "--schedule",
        "1f1b",
        "--local-batch",
        "4",
        "--seq-len",
        "64",
        "--json-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    rows = {(r["gpus"], r["layout"]): r for r in doc["rows"]}
    piped = {key for key in rows if "PP" in key[1]}
    assert piped == {(16, "FSDP 8 x PP 2 (1f1b)"), (32, "FSDP 16 x PP 2 (1f1b)"), (32, "HSDP 2 x 8 x PP 2 (1f1b)")}
    hsdp, within = rows[(32, "HSDP 2 x 8 x PP 2 (1f1b)")], rows[(16, "FSDP 8 x PP 2 (1f1b)")]
    assert (hsdp["dp_replicate"], hsdp["dp_shard"]) == (2, 8)
    assert hsdp["memory"] == within["memory"]
    # The last GPU paces the pipeline: half the blocks, the final norm and the output layer, a unit each block
    # and the rest, each unit's gradient shard all-reduced by the 2 replicas over --link.
    width, vocab = SMALL["hidden_size"], SMALL["vocab_size"]
    stage = (doc["parameters"] - 2 * vocab * width - width) / 2 + vocab * width + width
    units = scale_rows.fsdp_units(SMALL, stage, 4)
    assert sum(calls * count for calls, count in units) == pytest.approx(stage)
    across = sum(
        calls * nccl.collective_s("all_reduce", 4 * count / 8, 2, 2, 50e9, "nvlink")[0] for calls, count in units
    )
    assert hsdp["time"]["fsdp"] == pytest.approx(within["time"]["fsdp"] + across, rel=1e-9)


@pytest.mark.parametrize(
    "args, said",
    [
        (["--hf-config", "llama-3.1-8b"], "--hf-config plans a described GPU cluster"),
        (
            ["--hf-config", "README.md", "--gpu", "H100", "--gpus-per-node", "8"],
            "--hf-config README.md is not a model config: it cannot be read as JSON",
        ),
        (
            ["--hf-config", "no-such-model", "--gpu", "H100", "--gpus-per-node", "8"],
            "is neither a file nor a shipped config; give a config.json's path or one of deepseek-v2-lite, deepseek-v3, llama-3.1-405b",
        ),
        (
            ["--hf-config", "llama-3.1-8b", "--gpu", "H100", "--gpus-per-node", "8", "--ac", "some"],
            "--ac 'some' is not a checkpointing mode; choose one of none, selective, full",
        ),
        (
            ["--hf-config", "llama-3.1-405b", "--gpu", "H100", "--gpus-per-node", "8"],
            "llama-3.1-405b's 405.9 B parameters are 1,623 GB as fp32 weights alone, more than 8 GPUs x 80 GB = 640 GB",
        ),
        (
            ["--hf-config", "llama-3.1-8b", "--gpu", "H100", "--gpus-per-node", "8", "--tp", "3"],
            "--tp 3 does not divide the model's 32 attention heads; give a tp that divides 32 heads and 8 key/value heads",
        ),
        (
            ["--hf-config", "llama-3.1-8b", "--gpu", "H100", "--gpus-per-node", "4", "--tp", "8"],
            "--tp 8 is more than a node's 4 GPUs",
        ),
        (
            ["--hf-config", "mixtral-8x7b", "--gpu", "H100", "--gpus-per-node", "8", "--tp", "8"],
            "--tp 8: mixtral's blocks are not split by plain column and row products",
        ),
        (
            ["--hf-config", "llama-3.1-8b", "--gpu", "H100", "--gpus-per-node", "8", "--pp", "40"],
            "--pp 40 is more stages than the model's 32 decoder blocks; give a pp of at most 32",
        ),
        (
            ["--hf-config", "mixtral-8x7b", "--gpu", "H100", "--gpus-per-node", "8", "--ep", "3"],
            "--ep 3 does not divide mixtral's 8 experts a layer; give a divisor of 8",
        ),
        (
            ["--hf-config", "llama-3.1-8b", "--gpu", "H100", "--gpus-per-node", "8", "--ep", "2"],
            "--ep 2: llama has no experts to split (no module whose weights stack one matrix per expert)",
        ),
        (
            ["--model", "mlp", "--global-batch", "16"],
            "--global-batch 16 is --hf-config's; a --model plan's global batch is --batch-size",
        ),
        (
            ["--hf-config", "llama-3.1-8b", "--gpu", "H100", "--gpus-per-node", "8", "--nodes", "2"]
            + ["--nproc", "16", "--global-batch", "3"],
            "--global-batch 3 cannot be shared evenly by the data-parallel GPUs of any layout planned; give a"
            " multiple of the GPU counts (--nproc)",
        ),
        (
            ["--hf-config", "llama-3.1-405b", "--gpu", "H100", "--gpus-per-node", "8", "--nodes", "64"]
            + ["--pp", "8", "--microbatches", "0"],
            "--microbatches 0 must be at least 1",
        ),
    ],
    ids=[
        "no-cluster",
        "not-json",
        "unknown-name",
        "bad-ac",
        "weights-beyond-the-cluster",
        "tp-not-dividing-heads",
        "tp-beyond-a-node",
        "tp-of-experts",
        "pp-beyond-the-blocks",
        "ep-not-dividing-experts",
        "ep-without-experts",
        "global-batch-without-hf-config",
        "global-batch-no-layout-shares",
        "no-microbatches",
    ],
)
def test_bad_input_is_one_sentence(args, said):
    assert_refused_in_one_sentence(forked_torchfleet("plan", *args), said)


def test_a_mixture_of_experts_counts_its_grouped_experts_as_their_loop_would():
    """transformers runs Mixtral's experts as one grouped matrix product, whose FLOPs torch's table leaves out
    (a plan of Mixtral 8x7B counted a third of its step without them). The step counter's formula for it must
    give what torch's own formulas count when the same experts run one by one (experts_implementation
    "eager"), on real tensors: the same model, the same routing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 128,
    }
    counted = {}
    for experts in ("eager", "grouped_mm"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("mixtral", **fields, experts_implementation=experts)
        )
        tokens = torch.randint(0, 128, (2, 32))
        with step_counter() as counter:
            model(input_ids=tokens).logits.float().sum().backward()
        counted[experts] = counter.total
    assert counted["grouped_mm"] == counted["eager"] > 0


def test_deepseek_v3_counts_671b_parameters_from_its_whole_model_and_is_refused_on_one_node():
    # Counted over every block built on the meta device: its first 3 blocks are dense, the other 58 hold 256
    # experts each (a count carried from one block gave 37.4 B, and 671 B on 8 H100 was not refused).
    result = forked_torchfleet("plan", "--hf-config", "deepseek-v3", "--gpu", "H100", "--gpus-per-node", "8")
    assert_refused_in_one_sentence(result, "deepseek-v3's 671.0 B parameters are 2,684 GB as fp32 weights alone")


BUILDER = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIELDS = {fields!r}


def build():
    assert torch.empty(1).device.type == "meta", "plan calls the builder on the meta device"
    return LlamaForCausalLM(LlamaConfig(**FIELDS))
"""


def test_plan_model_calls_a_library_builder_on_meta_and_plans_it_at_scale(tmp_path):
    fields = {k: v for k, v in SMALL.items() if k not in ("architectures", "model_type", "torch_dtype")}
    (tmp_path / "builder.py").write_text(BUILDER.format(fields=fields))
    out = tmp_path / "plan.json"
    result = forked_torchfleet(
        "plan",
        *("--model", f"{tmp_path / 'builder.py'}:build", "--gpu", "H100", "--gpus-per-node", "8", "--nproc", "8"),
        *("--tp", "1", "--seq-len", "64", "--local-batch", "2", "--json-out", str(out)),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    with __import__("torch").device("meta"):
        parameters = sum(p.numel() for p in library_model.build(SMALL).parameters())
    assert doc["parameters"] == parameters and doc["hf_config"].endswith("builder.py:build")
    assert doc["workload"]["precision"] == "bf16"  # planned at scale, as --hf-config's models are
    assert doc["rows"] and all(row["peak"] > 0 for row in doc["rows"])


@pytest.mark.timeout(480)  # 205 s of 300 in CI (30 Nov)
def test_a_global_batch_is_honoured_on_every_row_by_accumulation_or_micro_batches(tmp_path):
    """--global-batch 12 on 2, 4 and 8 GPUs, at most 2 samples a GPU at once: FSDP 2 runs 3 passes of 2 samples,
    FSDP 4 3 passes of 1, FSDP 8 cannot share 12 samples evenly and is left out with a note; the pipelines of 2
    stages run a data-parallel GPU's share as micro-batches of one. Each pass pays its FLOPs and FSDP's
    collectives, and from the second on every GPU holds its shard's fp32 gradients."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    out = tmp_path / "plan.json"
    flags = ["--gpu", "H100", "--gpus-per-node", "8", "--nproc", "2,4,8", "--tp", "1", "--pp", "2"]
    flags += ["--schedule", "1f1b", "--seq-len", "64", "--local-batch", "2", "--global-batch", "12"]
    flags += ["--mfu", str(at_scale.AT_SCALE_EFFICIENCY)]
    # 400 s, not forked_torchfleet's default: beside CI's other lane this plan took up to 205 s (30 Nov).
    result = forked_torchfleet("plan", "--hf-config", str(config), *flags, "--json-out", str(out), timeout=400)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    rows = {r["layout"]: r for r in doc["rows"]}
    assert {r["global_batch"] for r in doc["rows"]} == {12}
    assert {name: r["batch"] for name, r in rows.items()} == {
        "FSDP 2": "2 x 3 x 2",
        "FSDP 4": "1 x 3 x 4",
        "FSDP 1 x PP 2 (1f1b)": "1 x 12 x 1",
        "FSDP 2 x PP 2 (1f1b)": "1 x 6 x 2",
        "FSDP 4 x PP 2 (1f1b)": "1 x 3 x 4",
    }
    assert "FSDP 8 left out: its 8 data-parallel GPUs cannot share a global batch of 12 evenly" in doc["notes"]
    assert rows["FSDP 1 x PP 2 (1f1b)"]["microbatches"] == 12
    one = trace.traced_at_scale(SMALL, trace.Workload(seq=64, local_batch=2), 2)
    fsdp2 = rows["FSDP 2"]
    assert fsdp2["flops"] == pytest.approx(3 * one.flops)
    t = fsdp2["time"]
    assert t["compute"] == pytest.approx(3 * one.flops / (989.4e12 * at_scale.AT_SCALE_EFFICIENCY))
    params = doc["parameters"]
    assert t["fsdp"] == pytest.approx(3 * _fsdp_wire(params, scale_rows.fsdp_units(SMALL, params), 2, 1, 450e9))
    assert fsdp2["memory"]["gradients"] >= 4 * params / 2
    for r in doc["rows"]:
        assert r["tokens_per_s_per_gpu"] == pytest.approx(12 * 64 / r["gpus"] / r["time"]["step"])
