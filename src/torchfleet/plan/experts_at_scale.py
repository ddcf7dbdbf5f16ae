"""Expert-parallel layouts for `plan --hf-config` (`--ep`, and by default for a model with experts): fsdp+ep.

As the fsdp+ep preset runs it (strategies/dims.py, expert_parallel.py): every GPU shards the model by
FSDP2 as FSDP over all of them does, and each group of ep neighbouring GPUs splits every layer's experts
among itself (E / ep each), sharding them by FSDP2 over the dp / ep groups. Tokens reach their experts'
GPU by all-to-all. ep borrows data-parallel GPUs, so tensor parallelism and pipelines are not beside it
(the strategy refuses them), and the layout is planned at tp 1.

The row reads the FSDP trace of the same GPUs (plan/trace.py), whose sharded state is already what
fsdp+ep holds (the experts' 1 / ep, sharded over dp / ep: 1 / dp, as FSDP's), and changes what ep changes:
- a block's gathered experts are its GPU's E / ep only: the gathered kinds (unsharded parameters and
  gradients, all-gather and reduce-scatter buffers) lose (1 - 1 / ep) of the experts' share of a block's
  parameters, taken as the share of what is gathered at every moment (the root, gathered at the ends, has no
  experts, so at its moments this takes off a little too much);
- FSDP2's copies into and out of those buffers (the trace's "gathering" bytes) shrink alike;
- one all-to-all's send and receive buffers are added at every moment: the rows of a layer, twice;
- FSDP's collectives move the rest over every GPU and each GPU's experts over its dp / ep group, both
  rings on the link they cross (a dp / ep group strides over the ep neighbours, so it spans the GPUs);
- the all-to-alls: each of the local batch's tokens sends k rows of the hidden width (k: the experts a
  token chooses) forward to its experts and takes them back, and backward sends the gradients both ways:
  4 a layer, 6 under full checkpointing, whose recomputed forward dispatches again (the selective policy
  is taken to keep their outputs, as recomputing a collective repeats its traffic); and the counts'
  small all-to-all before each dispatch. Each costs the two-level topology: within a node over its links
  when ep fits in one, else its share across nodes over the slower link, at the same time. In the critical
  path: the experts wait for their tokens.
Routing is taken as balanced (each expert gets its share of the rows); the FLOPs are the FSDP trace's.

`--ep-dispatch deepep` plans DeepEP's dispatch and combine instead (DeepSeek's library, which NeMo AutoModel's
MoE runs use): a token's row goes once to each GPU that holds any of its k experts, and the GPU sums its
experts' outputs before the one row comes back. With routing spread evenly, a GPU holds none of a token's
experts with probability C(E - E/ep, k) / C(E, k), so a token sends ep (1 - that) rows, not k: 5.4 of 8 for
Qwen3-30B-A3B's 128 experts, 8 a token, over 8 GPUs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from torchfleet.errors import UsageError
from torchfleet.plan import comm, global_batch, hardware, scale_rows, trace
from torchfleet.plan.experts import ALL_TO_ALLS_PER_LAYER, COUNT_BYTES
from torchfleet.plan.traced import Traced

GATHERED_KINDS = ("UNSHARDED_PARAM", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER")


def shape(fields: dict) -> dict:
    """The experts of the config's model, built on the meta device: experts a layer, layers holding them,
    their parameters, their share of the blocks' parameters, the experts a token chooses (k), and whether
    transformers runs them as one grouped product."""
    return dict(_shape(trace._Frozen(fields)))


@functools.lru_cache(maxsize=8)
def _shape(fields) -> tuple:
    import torch

    from torchfleet.plan import library_model
    from torchfleet.strategies.expert_parallel import find_experts

    with torch.device("meta"):
        model = library_model.build(dict(fields))
    found = find_experts(model)
    in_blocks = sum(p.numel() for p in library_model.blocks(model).parameters())
    experts = sum(p.numel() for _, module in found for p in module.parameters())
    config = library_model.transformers_config(dict(fields), 1)
    return (
        ("experts", next(found[0][1].parameters(recurse=False)).shape[0] if found else 0),
        ("layers", len(found)),
        ("parameters", experts),
        ("block_share", experts / in_blocks if in_blocks else 0.0),
        ("top_k", int(getattr(config, "num_experts_per_tok", None) or 1)),
        # transformers 5 runs experts through torch._grouped_mm, which takes bf16 or fp16 only; 4 loops over them.
        ("grouped_mm", getattr(model.config, "_experts_implementation_internal", None) == "grouped_mm"),
    )


def check_degree(fields: dict, ep: int) -> None:
    """One sentence if `ep` cannot split this model's experts: it has none, or ep does not divide them."""
    if ep == 1:
        return
    experts = shape(fields)["experts"]
    if not experts:
        raise UsageError(
            f"--ep {ep}: {fields['model_type']} has no experts to split (no module whose weights stack one"
            " matrix per expert); plan ep with a mixture-of-experts config, such as mixtral-8x7b"
        )
    if experts % ep:
        raise UsageError(
            f"--ep {ep} does not divide {fields['model_type']}'s {experts} experts a layer; give a divisor of {experts}"
        )


def check_options(fields: dict, precision: str, dispatch: str) -> None:
    """One sentence where the plan's options cannot apply to this model's experts (or to its lack of them)."""
    found = shape(fields)
    if dispatch != "all-to-all" and not found["experts"]:
        raise UsageError(
            f"--ep-dispatch {dispatch} plans how fsdp+ep's tokens reach their experts, and"
            f" {fields['model_type']} has no experts; leave it out"
        )
    if precision == "fp32" and found["grouped_mm"]:
        raise UsageError(
            f"--precision fp32 cannot trace {fields['model_type']}'s experts: transformers runs them through"
            " torch._grouped_mm, which takes bf16 or fp16 only; plan with --precision bf16"
        )


def default_eps(fields: dict, per_node: int) -> tuple[int, ...]:
    """For a model with experts: the most of a node's GPUs that divide the experts, so that the all-to-alls
    stay on the node's links (none for a model without experts, or a node of one GPU)."""
    experts = shape(fields)["experts"]
    fitting = [d for d in range(2, min(experts, per_node) + 1) if experts % d == 0]
    return (max(fitting),) if fitting else ()


def rows_per_token(experts: int, top_k: int, ep: int, dispatch: str) -> float:
    """The rows one token sends a dispatch (and takes back a combine): one per chosen expert, or under DeepEP
    one per GPU holding any of them, in expectation over evenly spread routing (the module docstring)."""
    if dispatch == "all-to-all" or ep <= 1:
        return float(top_k)
    none = math.comb(experts - experts // ep, top_k) / math.comb(experts, top_k)
    return ep * (1 - none)


def row(fields: dict, work: trace.Workload, gpus: int, ep: int, params: int, request) -> dict | str:
    """One fsdp+ep layout, or a note where its GPUs, all data-parallel, cannot share the global batch."""
    experts = shape(fields)
    reach = global_batch.reach(request.global_batch, request.local_batch, gpus)
    if reach is None:
        return global_batch.left_out(f"FSDP {gpus} + EP {ep}", gpus, request.global_batch or 0)
    one = trace.traced_at_scale(fields, replace(work, local_batch=reach.local), gpus)
    traced = global_batch.accumulating(one, 4 * params / gpus, reach.passes)
    act_bytes = 2 if request.precision == "bf16" else 4
    rows = rows_per_token(experts["experts"], experts["top_k"], ep, request.ep_dispatch)
    routed = reach.local * request.seq * rows * fields["hidden_size"] * act_bytes
    split = split_experts(traced, experts["block_share"], ep, 2 * routed)
    timing = step_time(split, params, experts, fields, gpus, ep, routed, request, reach.passes)
    return scale_rows.table_row(
        request,
        gpus=gpus,
        tp=1,
        ep=ep,
        replicas=1,
        shard=gpus,
        layout=f"FSDP {gpus} + EP {ep}",
        memory=scale_rows.memory_columns(split.kinds),
        peak=split.peak,
        flops=split.flops * reach.passes,
        collectives=split.collectives,
        timing=timing,
        reach=reach,
    )


def split_experts(traced: Traced, block_share: float, ep: int, buffers: float) -> Traced:
    """`traced` (FSDP's) with each block's gathered experts cut to 1 / ep and `buffers` of all-to-all added."""
    kept = 1 - block_share * (1 - 1 / ep)
    moments = tuple(
        {**{k: v * kept if k in GATHERED_KINDS else v for k, v in m.items()}, "ALL_TO_ALL": buffers}
        for m in traced.moments
    )
    # FSDP2's copies into and out of its buffers move what is gathered, so they shrink alike.
    work = tuple((kind, amount * kept if kind == "gathering" else amount) for kind, amount in traced.work)
    return replace(traced, moments=moments, work=work)


def all_to_all_s(nbytes: float, ep: int, target: hardware.Target) -> float:
    """One all-to-all of `nbytes` a GPU among ep neighbours: to those on its node over the node's links and
    to the others over the link between nodes, at once; a message's latency to each."""
    if ep <= 1:
        return 0.0
    within = min(ep, target.per_node)
    inside = comm.all_to_all_s(nbytes * within / ep, within, target.intra) if within > 1 else 0.0
    across = (ep - within) / ep * nbytes / target.inter.bandwidth + (ep - within) * target.inter.latency
    return max(inside, across) if ep > within else inside


def step_time(
    traced: Traced,
    params: int,
    experts: dict,
    fields: dict,
    gpus: int,
    ep: int,
    routed: float,
    request,
    passes: int = 1,
) -> dict:
    """at_scale.step_time's parts for fsdp+ep (the module docstring): compute, FSDP's collectives, hidden
    behind compute but one block's share, and the all-to-alls, not hidden; each `passes` times a step."""
    target = request.target
    compute = passes * target.compute_s(traced.flops, traced.work)
    link = target.link_for(gpus)
    param_bytes = 2 if request.precision == "bf16" else 4
    rest, local_experts = params - experts["parameters"], experts["parameters"] / ep
    # Unit by unit, each its own call: the blocks' rest and the root over every GPU, each layer's experts (a
    # unit of their own) over its dp / ep group.
    fsdp = passes * (
        scale_rows.fsdp_s(scale_rows.fsdp_units(fields, rest), param_bytes, gpus, link)
        + scale_rows.fsdp_s(
            ((experts["layers"], local_experts / max(1, experts["layers"])),), param_bytes, gpus // ep, link
        )
    )
    full = request.ac == "full"
    rows_calls = experts["layers"] * (ALL_TO_ALLS_PER_LAYER + (2 if full else 0))
    count_calls = experts["layers"] * (2 if full else 1)
    ep_s = passes * rows_calls * all_to_all_s(routed, ep, target) + passes * count_calls * all_to_all_s(
        experts["experts"] * COUNT_BYTES, ep, target
    )
    return scale_rows.fsdp_overlapped(compute, fsdp, fields["num_hidden_layers"], ep=ep_s)
