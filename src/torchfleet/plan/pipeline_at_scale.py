"""Pipeline layouts for `plan --hf-config --pp`: the model cut into stages of blocks (torchtitan's split), each
stage's step traced on fake tensors, the schedule's fill and drain from plan/pipelines.py, and what it holds at
its peak from the order of actions torch's schedule runs (plan/schedule_memory.py).

As torchtitan runs them: pp outermost in the device mesh (a stage's neighbours are dp x tp ranks away,
on another node once a stage fills one), micro-batches of one sample (its default; --microbatches sets a
count instead), so the local batch is the number of micro-batches, and FSDP sharding each stage's blocks over the dp ranks, gathered once a
step and kept (reshard_after_forward off, torchtitan's default under pp), the gradients accumulated
unsharded in fp32 and reduce-scattered after the last micro-batch (as torch's pipeline stage drives
FSDP2). With a stage's ranks spread over several nodes, HSDP rows shard within a node and
all-reduce the gradient shards across the nodes, as at_scale.py's rows without pp. A GPU's stages are
traced as the model with its share of the blocks, at micro-batch 1 and 2: the first GPU's with the token
embedding (it holds the most micro-batches in flight), the last GPU's with the final norm and the output
layer (the most parameters, and the FLOPs that pace the pipeline), each taking and giving hidden states
where a neighbour sends or receives them. The row's memory is the fuller of the two. Under tensor
parallelism the split embedding and output layer stay together on the one stage traced. More micro-batches
in flight add what a micro-batch leaves in the stage's blocks, once each; the gradients accumulated in fp32
over the micro-batches are added, as much of them as the schedule holds at once, where the trace of one
holds less.
"""

from __future__ import annotations

from dataclasses import replace

from torchfleet.errors import UsageError
from torchfleet.plan import comm, global_batch, library_model, pipelines, scale_rows, schedule_memory, trace
from torchfleet.plan.traced import Traced
from torchfleet.strategies.pipeline.schedules import microbatch_problem

SCHEDULES = ("1f1b", "interleaved-1f1b")  # torchtitan's two in its published 405B table
MICROBATCH = 1  # samples a micro-batch, torchtitan's default


def check_degree(fields: dict, pp: int) -> None:
    layers = fields["num_hidden_layers"]
    if pp > 1 and library_model.kind(fields) != "decoder":
        raise UsageError(
            f"--pp {pp}: plan cuts a decoder's blocks into stages, and {fields['model_type']} is an"
            f" {library_model.kind(fields)} model; plan it without --pp"
        )
    if pp > layers:
        raise UsageError(
            f"--pp {pp} is more stages than the model's {layers} decoder blocks; give a pp of at most {layers}"
        )


def blocks_per_gpu(layers: int, pp: int, v: int) -> int:
    """The blocks of the fullest GPU's stages. torchtitan splits a count that does not divide into stages of
    two sizes, the larger one block more (its generate_split_points); the plan traces a GPU holding only them."""
    return -(-layers // (pp * v)) * v


def schedules_for(fields: dict, pp: int, requested: str | None) -> tuple[tuple[str, int], ...]:
    """(schedule, stages a GPU) pairs planned for `pp`: the requested schedule, else both of SCHEDULES where the
    model has a block for each of their stages."""
    names = (requested,) if requested else SCHEDULES
    chosen = []
    for name in names:
        v = pipelines.stages_per_process(name, None)
        if fields["num_hidden_layers"] >= pp * v:
            chosen.append((name, v))
    return tuple(chosen)


def microbatch_size(request, dp: int) -> int:
    """Samples a micro-batch: one (torchtitan's default), or a data-parallel GPU's share of the global batch
    split into --microbatches; 0 where they do not split it evenly (the row is then left out)."""
    count = getattr(request, "microbatches", None)
    if not count:
        return MICROBATCH
    per_gpu = request.local_batch if request.global_batch is None else request.global_batch // dp
    return per_gpu // count if per_gpu % count == 0 else 0


def hsdp_replicas(gpus: int, pp: int, tp: int, per_node: int) -> int:
    """Replicas of each stage for HSDP under pp: shards within a node, replicas across the nodes a stage's
    dp x tp ranks span; 0 where a stage fits in a node or a node holds fewer than two shards."""
    group = gpus // pp  # a stage's dp x tp ranks, consecutive (pp is outermost)
    shard = per_node // tp if per_node % tp == 0 else 0
    if group <= per_node or shard < 2 or group % (shard * tp):
        return 0
    return group // (shard * tp)


def stage_parameters(fields: dict, params: int, pp: int, role: str, blocks: int | None = None) -> float:
    """Parameters a GPU's stages hold (tp 1): its `blocks` (default: its even share), the embedding on the first,
    the final norm and the output layer on the last (a tied output layer is a copy there); "whole" counts both
    ends."""
    vocab_by_width = fields["vocab_size"] * fields["hidden_size"]
    tied = fields.get("tie_word_embeddings", False)
    in_blocks = params - vocab_by_width * (1 if tied else 2) - fields["hidden_size"]
    first = vocab_by_width if role in ("first", "whole") else 0
    last = vocab_by_width + fields["hidden_size"] if role in ("last", "whole") else 0
    share = 1 / pp if blocks is None else blocks / fields["num_hidden_layers"]
    return in_blocks * share + first + last


def _stage(
    stage_fields: dict, kept: trace.Workload, shard: int, role: str, parameters: float, order: tuple[str, int, int, int]
):
    """One GPU's stage traced at one micro-batch, and its memory at the peak of the schedule's order of actions
    (plan/schedule_memory.py; `order` is the schedule, pp, micro-batches and stages a GPU): each further
    micro-batch in flight holding what one's forward leaves for its backward, and the share of the stage's
    gradients, fp32 and unsharded, that its backwards have made and not yet reduce-scattered."""
    work = replace(kept, stage=role)
    one = trace.traced_at_scale(stage_fields, work, shard)
    grouped = scale_rows.memory_columns(one.kinds)
    schedule, pp, m, v = order
    rank = pp - 1 if role == "last" else 0
    gradients = 4 * parameters / kept.tp
    # A micro-batch in flight waits between its blocks' forward and backward; the output layer's logits and
    # loss live only from the last stage's forward to its backward, which follows at once, so held counts blocks.
    a, b = (trace.traced_at_scale({**stage_fields, "num_hidden_layers": d}, work, shard) for d in trace.TRACE_DEPTHS)
    blocks = (b.held - a.held) / (b.layers - a.layers) * stage_fields["num_hidden_layers"]
    at = schedule_memory.peak(schedule, pp, m, v, rank, blocks, gradients)
    grouped["activations"] += (at.microbatches - 1) * blocks
    if m > 1:  # one micro-batch reduce-scatters at once; more accumulate, and the last reduce-scatters
        grouped["gradients"] += max(0.0, at.gradients * gradients - one.kinds.get("UNSHARDED_GRAD", 0.0))
    return one, grouped


def row(
    fields: dict,
    work: trace.Workload,
    gpus: int,
    pp: int,
    schedule: str,
    v: int,
    params: int,
    request,
    replicas: int = 1,
) -> dict | str:
    """One pipeline layout; `replicas` > 1: HSDP in each stage, its dp ranks `replicas` x shards. Its memory is
    the fuller of the first GPU's and the last's; its pace is the last GPU's, which runs the output layer. A
    note instead where its data-parallel GPUs cannot share the global batch asked for."""
    tp = work.tp
    dp = gpus // (tp * pp)
    shard = dp // replicas
    name = f"{scale_rows.layout_name(replicas, shard, tp)} x PP {pp} ({schedule})"
    size = microbatch_size(request, dp)
    if size == 0:
        return f"{name} left out: its GPUs' share of the batch does not split into {request.microbatches} micro-batches"
    reach = global_batch.reach(request.global_batch, request.local_batch, dp, size)
    if reach is None:
        return global_batch.left_out(name, dp, request.global_batch or 0)
    m = reach.passes
    problem = microbatch_problem(schedule, pp, m)
    if problem:  # torch's schedule refuses the count, so there is no order of actions to plan
        return f"{name} left out: {problem}"
    blocks = blocks_per_gpu(fields["num_hidden_layers"], pp, v)
    stage = {**fields, "num_hidden_layers": blocks}
    kept = replace(work, local_batch=reach.local, reshard_after_forward=False)
    # tp's split embedding and output layer expect each other's layouts: under tp both ends stay on one stage.
    ends = ["first", "last"] if tp == 1 else ["whole"]
    stages = {
        role: _stage(stage, kept, shard, role, stage_parameters(fields, params, pp, role, blocks), (schedule, pp, m, v))
        for role in ends
    }  # the states shard over one replica's ranks only
    fullest = max(stages, key=lambda role: sum(stages[role][1].values()))
    grouped = stages[fullest][1]
    pacing = ends[-1]
    one = stages[pacing][0]
    timing = step_time(
        one,
        stage_parameters(fields, params, pp, pacing, blocks),
        stage["num_hidden_layers"],
        gpus,
        pp,
        m,
        schedule,
        v,
        fields,
        request,
        replicas,
        reach.local,
    )
    return scale_rows.table_row(
        request,
        gpus=gpus,
        tp=tp,
        pp=pp,
        schedule=schedule,
        microbatches=m,
        peak_stage=fullest,
        replicas=replicas,
        shard=shard,
        layout=name,
        memory=grouped,
        peak=sum(grouped.values()),
        flops=one.flops * m,
        timing=timing,
        collectives=tuple((kind, nbytes * m, calls * m) for kind, nbytes, calls in one.collectives),
        reach=reach,
    )


def step_time(
    one: Traced,
    stage_params: float,
    blocks: int,
    gpus: int,
    pp: int,
    m: int,
    schedule: str,
    v: int,
    fields: dict,
    request,
    replicas: int = 1,
    microbatch: int = MICROBATCH,
) -> dict:
    """A GPU's step: m micro-batches through its stages, the schedule's idle slots (plan/pipelines.py), each
    micro-batch's tensor-parallel collectives, its activations and their gradients sent to the neighbouring
    stages (not hidden), and FSDP's collectives for the stage's blocks, once a step, behind compute; under
    HSDP also the all-reduce of each rank's gradient shard across the stage's replicas, between nodes."""
    target = request.target
    tp = gpus // (one.world * pp * replicas)
    per_microbatch = target.compute_s(one.flops, one.work)
    busy, idle = pipelines.bubble_slots(schedule, pp, m, v)
    compute = busy * per_microbatch / v
    bubble = idle * per_microbatch / v
    # One gather of the stage's bf16 parameters and one reduce-scatter of its fp32 gradients a step, unit by unit.
    shard_link = target.link_for(one.world * tp)
    param_bytes = 2 if request.precision == "bf16" else 4
    units = scale_rows.fsdp_units(fields, stage_params, blocks)
    fsdp = scale_rows.fsdp_s(
        tuple((calls, count / tp) for calls, count in units),
        param_bytes,
        one.world,
        shard_link,
        replicas,
        target.link_for(gpus // pp),
        gathers=1,
    )
    tensor = scale_rows.collectives_s(one, tp, target) * m
    # The sequence-parallel activation a tp rank holds, in bf16: what crosses to the next stage.
    boundary = microbatch * request.seq * fields["hidden_size"] * 2 / tp
    link = target.link_for(2 * gpus // pp)
    sends = 2 * busy * comm.send_s(boundary, link)  # forward's activation and backward's gradient, every slot
    timing = scale_rows.fsdp_overlapped(compute, fsdp, blocks, tp=tensor, p2p=sends)
    return {**timing, "step": timing["step"] + bubble, "bubble": bubble}  # the idle slots hide nothing
