"""What every `plan --hf-config` row is made of, whichever layout made it: the memory columns, the
allocator's reserve over the tensors, the layout's name, the cost of the tensor-parallel collectives
a trace counted, a step's seconds from its parts (fsdp_overlapped), and the row itself (table_row).
plan/at_scale.py makes the FSDP, HSDP and tensor-parallel rows, plan/pipeline_at_scale.py the pipeline
rows, plan/experts_at_scale.py the expert-parallel rows.
"""

from __future__ import annotations

from torchfleet.plan import comm, hardware, overlap
from torchfleet.plan.global_batch import Reach
from torchfleet.plan.traced import Traced
from torchfleet.strategies.registry import DP_REPLICATE, DP_SHARD, PP, TP

# What the CUDA caching allocator holds (reserved) over the tensors' own peak (allocated). Published runs report
# the reserved figure, and a GPU runs out of memory when its reserve cannot grow, so the plan's tensors are scaled
# by it. One figure for every plan, as the plan has no model of the allocator: the mean of two real FSDP2 steps
# on one GPU, selective and full recomputation, with expandable segments as torchtitan's launcher sets them
# (the cells and the figure without them: docs/benchmarks/history.md, "Planning at scale on fake tensors").
RESERVED_OVER_ALLOCATED = 1.135
# The tracker's kinds, grouped as the table shows them.
COLUMNS = {
    "parameters": ("SHARDED_PARAM", "UNSHARDED_PARAM", "BUFFER"),
    "gradients": ("SHARDED_GRAD", "UNSHARDED_GRAD"),
    "optimizer": ("OPT",),
    "activations": ("ACT", "INP"),
    "temporaries": ("TEMP",),
    "comm buffers": ("ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL"),  # the last: expert parallelism's
}


def memory_columns(kinds: dict[str, float]) -> dict[str, float]:
    """The tracker's bytes by kind, summed into the table's columns."""
    return {name: sum(kinds.get(k, 0.0) for k in grouped) for name, grouped in COLUMNS.items()}


def table_row(
    request,
    *,
    gpus: int,
    tp: int,
    replicas: int,
    shard: int,
    layout: str,
    memory: dict[str, float],
    peak: float,
    flops: float,
    collectives: tuple,
    timing: dict,
    reach: Reach,
    pp: int | None = None,
    **extra,
) -> dict:
    """One row of the table. `collectives`: (kind, bytes, calls) of the step; `reach`: how its data-parallel
    GPUs reach its global batch; `extra`: the layout's own fields (a pipeline's schedule and micro-batches),
    placed after the degrees; `pp` only in a pipeline's row."""
    reserved = peak * RESERVED_OVER_ALLOCATED
    return {
        "gpus": gpus,
        TP: tp,
        **({PP: pp} if pp is not None else {}),
        **extra,
        DP_REPLICATE: replicas,
        DP_SHARD: shard,
        "layout": layout,
        "nodes": -(-gpus // request.per_node),
        "memory": memory,
        "peak": peak,
        "flops": flops,
        "collectives": {kind: {"bytes": nbytes, "calls": calls} for kind, nbytes, calls in collectives},
        "time": timing,
        # A tensor-parallel group shares its samples, and so do a pipeline's stages: each GPU moves
        # 1/(tp x pp) of their tokens.
        "tokens_per_s_per_gpu": reach.per_gpu * request.seq / (tp * (pp or 1)) / timing["step"],
        "reserved": reserved,
        "fits": peak <= request.memory_bytes,
        "tight": peak <= request.memory_bytes < reserved,
        "global_batch": reach.global_batch,
        "batch": reach.describe(),  # samples at once x passes a step x data-parallel GPUs
    }


def layout_name(replicas: int, shard: int, tp: int) -> str:
    data = f"HSDP {replicas} x {shard}" if replicas > 1 else f"FSDP {shard}"
    return data + (f" x TP {tp}" if tp > 1 else "")


def collectives_s(traced: Traced, tp: int, target: hardware.Target) -> float:
    """The traced tensor-parallel collectives' seconds: rings over the tp ranks of one node."""
    within = target.link_for(tp)
    costs = {"all_gather": comm.all_gather_s, "reduce_scatter": comm.reduce_scatter_s, "all_reduce": comm.all_reduce_s}
    # Each call pays its hops' latency; the formulas are linear in bytes, so calls x one average call.
    return sum(calls * costs[kind](nbytes / calls, tp, within) for kind, nbytes, calls in traced.collectives if calls)


def fsdp_units(fields: dict, params: float, blocks: int | None = None) -> tuple[tuple[int, float], ...]:
    """(calls, parameters each) of FSDP2's units, each its own collective: every decoder block (`blocks` of
    them, the config's by default), and the root's embedding, final norm and output layer."""
    blocks = blocks or fields["num_hidden_layers"]
    tied = fields.get("tie_word_embeddings", False)
    root = min(params, fields["vocab_size"] * fields["hidden_size"] * (1 if tied else 2) + fields["hidden_size"])
    return ((blocks, (params - root) / blocks), (1, root))


def fsdp_s(
    units: tuple[tuple[int, float], ...],
    param_bytes: int,
    shard: int,
    shard_link: comm.Link,
    replicas: int = 1,
    replica_link: comm.Link | None = None,
    gathers: int = 2,
) -> float:
    """A step's FSDP2 collectives, unit by unit: `gathers` all-gathers of its parameters in `param_bytes` (forward,
    and again in backward where it reshards after forward), a reduce-scatter of its fp32 gradients over the
    `shard` ranks, and under HSDP an all-reduce of each rank's gradient shard across the `replicas`."""
    total = 0.0
    for calls, count in units:
        total += calls * (
            gathers * comm.all_gather_s(count * param_bytes, shard, shard_link)
            + comm.reduce_scatter_s(count * 4, shard, shard_link)
            + (comm.all_reduce_s(count / shard * 4, replicas, replica_link) if replica_link is not None else 0.0)
        )
    return total


def fsdp_overlapped(compute: float, fsdp: float, blocks: int, **unhidden: float) -> dict:
    """A step's seconds from its compute, FSDP's collectives (prefetched behind compute, but for one block's
    share, and whatever exceeds the compute; the part hidden slows the compute it overlaps, plan/overlap.py)
    and collectives no compute hides (`unhidden`, by name: tp, ep). `exposed`: what communication adds to the
    compute, the overlap's slowdown (`overlap`) included."""
    waited = sum(unhidden.values())
    fsdp_exposed = fsdp / blocks + max(0.0, fsdp - compute)
    slowdown = overlap.slowed_s(fsdp - fsdp_exposed)
    exposed = fsdp_exposed + slowdown + waited
    communication = fsdp + waited
    return {
        "step": compute + exposed,
        "compute": compute,
        "communication": communication,
        "fsdp": fsdp,
        "tp": 0.0,
        **unhidden,
        "overlap": slowdown,
        "exposed": exposed,
        "bound": "compute" if compute >= communication else "communication",
    }
