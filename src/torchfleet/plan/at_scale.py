"""`plan --hf-config`: a library model under FSDP or HSDP, with or without tensor parallelism or expert
parallelism, on a described GPU cluster, at any size: memory per GPU and step time for each layout, and the fastest layout
that fits.

The model is never allocated: its step is traced on fake tensors
(plan/trace.py), once per checkpointing mode and tensor-parallel degree, and
each number of GPUs reads the same trace with its own sharding. The step's time
is its traced operators, each at the rate that bounds it (plan/kernels.py; a GPU
or precision outside its table, or --mfu or --tflops, at one fraction of the peak), tensor
parallelism's traced collectives over the node's links (exposed: each one
stands between two products), and FSDP's collectives over the link they cross,
overlapped with compute, which runs slower for it (`step_time`, plan/overlap.py).
Pipeline layouts (`--pp`) are built in plan/pipeline_at_scale.py, expert-parallel
ones (`--ep`, and by default for a model with experts) in plan/experts_at_scale.py.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, replace

from torchfleet.errors import UsageError
from torchfleet.plan import (
    experts_at_scale,
    global_batch,
    hardware,
    library_model,
    pipeline_at_scale,
    tensor_parallel,
    trace,
)
from torchfleet.plan.scale_rows import (
    COLUMNS,
    RESERVED_OVER_ALLOCATED,
    collectives_s,
    fsdp_overlapped,
    fsdp_s,
    fsdp_units,
    layout_name,
    memory_columns,
    table_row,
)
from torchfleet.plan.traced import Traced

SCHEMA = "torchfleet-plan-at-scale/1"
# Bytes a parameter costs in training whatever the layout: the fp32 master weight, its fp32 gradient and
# AdamW's two fp32 moments.
TRAINING_BYTES_PER_PARAM = 16
# The fraction of a GPU's dense peak that a large transformer's step reaches, on FLOPs as FlopCounterMode counts
# them (recomputation included, attention unhalved), where plan/kernels.py cannot price each operator (a GPU
# outside its table, fp32, --tflops); --mfu overrides it, and the table, everywhere. The mean of the same two GPU steps as scale_rows.RESERVED_OVER_ALLOCATED
# (docs/benchmarks/history.md, "Planning at scale on fake tensors").
AT_SCALE_EFFICIENCY = 0.48


@dataclass(frozen=True)
class ScaleRequest:
    hf_config: str  # the shipped name or path, or the --model builder that made the model
    seq: int
    local_batch: int
    ac: str
    precision: str
    counts: tuple[int, ...]  # GPUs planned
    per_node: int
    memory_bytes: float  # one GPU's
    gpu_name: str  # the cluster, as "16 x 8 H100"
    gpu_label: str  # one GPU with a space after it, as "H100 ", or "" for one given by its figures
    target: hardware.Target  # its rate is the achieved FLOP/s: `efficiency` of the GPU's dense peak
    efficiency: float
    tps: tuple[int, ...] = ()  # tensor-parallel degrees; empty: 1 and a node's GPUs where they divide the model
    pps: tuple[int, ...] = (1,)  # pipeline degrees
    schedule: str | None = None  # the pipelines' schedule; None: pipeline_at_scale.SCHEDULES
    eps: tuple[int, ...] = ()  # expert-parallel degrees (fsdp+ep); empty: experts_at_scale.default_eps
    fields: dict | None = None  # the config's fields where they come from a --model builder, not a file
    global_batch: int | None = None  # every row's (plan/global_batch.py); None: local_batch a data-parallel GPU
    microbatches: int | None = None  # a pipeline's a step; None: micro-batches of one sample
    decoder_seq: int | None = None  # an encoder-decoder's decoder tokens a sample; None: seq
    compile: tuple[str, ...] = ()  # what torch.compile compiles (plan/compiled.py)
    attention: str = "fused"  # kernels.ATTENTION
    ep_dispatch: str = "all-to-all"  # kernels.DISPATCH


def request_of(cfg) -> ScaleRequest:
    """The at-scale request from plan's config (PlanConfig checked its flags) and its described cluster."""
    from torchfleet.plan.run import cluster_counts

    efficiency = AT_SCALE_EFFICIENCY if cfg.mfu is None else cfg.mfu
    target = hardware.gpu_cluster(
        nodes=cfg.nodes or 1,
        per_node=cfg.gpus_per_node or 1,
        gpu=cfg.gpu,
        tflops=cfg.tflops,
        memory_gb=cfg.memory_gb,
        mfu=efficiency,
        precision=cfg.precision,
        intra_gbit=cfg.intra_gbit,
        inter_gbit=cfg.link_gbit,
        by_operator=cfg.mfu is None,
        compile=bool(cfg.compile),
        float8=cfg.float8,
        attention=getattr(cfg, "attention", "fused"),
    )
    return ScaleRequest(
        cfg.hf_config or cfg.model,
        cfg.seq_len or library_model.default_seq(cfg.library_fields or library_model.read_config(cfg.hf_config)),
        *(cfg.local_batch, cfg.ac, cfg.precision, cluster_counts(cfg, target), target.per_node),
        *(target.memory_bytes, target.name, f"{cfg.gpu} " if cfg.gpu else "", target, efficiency),
        *(tuple(cfg.tp), tuple(cfg.pp) or (1,), cfg.schedule, tuple(cfg.ep), cfg.library_fields),
        getattr(cfg, "global_batch", None),
        getattr(cfg, "microbatches", None),
        getattr(cfg, "decoder_seq_len", None),
        tuple(getattr(cfg, "compile", ())),
        getattr(cfg, "attention", "fused"),
        getattr(cfg, "ep_dispatch", "all-to-all"),
    )


def plan_at_scale(request: ScaleRequest, say=print) -> dict:
    fields = request.fields or library_model.read_config(request.hf_config)
    params = library_model.parameter_count(fields)
    _refuse_weights_beyond_the_cluster(request, params)
    tps = request.tps or default_tps(fields, request.per_node)
    for tp in tps:
        tensor_parallel.check_degree(fields, tp)
    for pp in request.pps:
        pipeline_at_scale.check_degree(fields, pp)
    for ep in request.eps:
        experts_at_scale.check_degree(fields, ep)
    experts_at_scale.check_options(fields, request.precision, request.ep_dispatch)
    eps = tuple(ep for ep in request.eps or experts_at_scale.default_eps(fields, request.per_node) if ep > 1)
    if request.decoder_seq and library_model.kind(fields) != "encoder-decoder":
        raise UsageError(
            f"--decoder-seq-len is an encoder-decoder's (T5's), and {fields['model_type']} is"
            f" a{'n' if library_model.kind(fields) == 'encoder' else ''} {library_model.kind(fields)} model;"
            " leave it out"
        )
    work = trace.Workload(
        seq=request.seq,
        local_batch=request.local_batch,
        ac=request.ac,
        precision=request.precision,
        decoder_seq=request.decoder_seq,
        compiled=tuple(request.compile),
        attention=request.attention,
    )
    say(
        f"tracing one training step of {request.hf_config} ({params / 1e9:,.1f} B parameters) on fake tensors:"
        f" sequence {request.seq}"
        + (f" (decoder {request.decoder_seq})" if request.decoder_seq else "")
        + f", local batch {request.local_batch}, checkpointing {request.ac},"
        f" tensor parallelism {', '.join(map(str, tps))}"
        + (f", pipelines of {', '.join(map(str, request.pps))} stages" if request.pps != (1,) else "")
        + (f", expert parallelism {', '.join(map(str, eps))}" if eps else "")
    )
    began = time.perf_counter()
    rows = []
    for tp in tps:
        for gpus in request.counts:
            if gpus % tp:
                continue
            rows.append(_row(fields, replace(work, tp=tp), gpus, params, request))
            # HSDP: shard within a node, replicate across nodes (torchtitan's dp_replicate x dp_shard).
            shard = request.per_node // tp if request.per_node % tp == 0 else 0
            if gpus > request.per_node and shard >= 2 and gpus % (shard * tp) == 0:
                rows.append(_row(fields, replace(work, tp=tp), gpus, params, request, gpus // (shard * tp)))
    for pp in (pp for pp in request.pps if pp > 1):
        for schedule, v in pipeline_at_scale.schedules_for(fields, pp, request.schedule):
            for tp in tps:
                for gpus in (g for g in request.counts if g % (tp * pp) == 0):
                    rows.append(
                        pipeline_at_scale.row(fields, replace(work, tp=tp), gpus, pp, schedule, v, params, request)
                    )
                    replicas = pipeline_at_scale.hsdp_replicas(gpus, pp, tp, request.per_node)
                    if replicas > 1:
                        rows.append(
                            pipeline_at_scale.row(
                                fields, replace(work, tp=tp), gpus, pp, schedule, v, params, request, replicas
                            )
                        )
    for ep in eps:
        for gpus in (g for g in request.counts if g >= ep and g % ep == 0):
            rows.append(experts_at_scale.row(fields, replace(work, tp=1), gpus, ep, params, request))
    left = [r for r in rows if isinstance(r, str)]
    rows = [r for r in rows if not isinstance(r, str)]
    if not rows:
        raise UsageError(
            f"--global-batch {request.global_batch} cannot be shared evenly by the data-parallel GPUs of any"
            " layout planned; give a multiple of the GPU counts (--nproc)"
        )
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hf_config": request.hf_config,
        "model_type": fields["model_type"],
        "parameters": params,
        "workload": {
            "seq": request.seq,
            "local_batch": request.local_batch,
            "ac": request.ac,
            "precision": request.precision,
            "global_batch": request.global_batch,
            "compile": list(request.compile),
            "attention": request.attention,
            "ep_dispatch": request.ep_dispatch,
        },
        "gpu_memory_bytes": request.memory_bytes,
        "target": request.gpu_name,
        "rows": rows,
        "recommendation": recommend(rows, request),
        "trace_s": round(time.perf_counter() - began, 1),
        "efficiency": request.efficiency,
        "achieved_flops_per_s": request.target.rate,
        "notes": left
        + [
            f"peak/GPU is the tensors' peak as FSDPMemTracker follows them on fake tensors (what"
            f" max_memory_allocated reads on a GPU); reserved is {RESERVED_OVER_ALLOCATED} times it, the"
            " caching allocator's measured overhead with expandable segments; a step whose tensors fit"
            " but whose reserve does not is tight",
            "step time: "
            + (
                "each traced operator at the rate that bounds it on this GPU (plan/kernels.py)"
                + (f", compiled ({', '.join(request.compile)})" if request.compile else "")
                + (", float8 products" if request.target.compute.float8 else "")
                if request.target.compute is not None and request.target.compute.kernels is not None
                else f"the traced FLOPs at {request.efficiency:.0%} of the GPU's dense peak (--mfu)"
            )
            + "; FSDP's all-gathers and reduce-scatter over the link they cross, hidden behind"
            " compute but for one block's share; tensor parallelism's traced collectives over the"
            " node's links, not hidden",
        ]
        + (
            [
                "FSDP n + EP e (fsdp+ep): the experts split over e neighbouring GPUs and sharded over the"
                " n / e groups, the rest sharded over all n; their all-to-alls (k rows of each token, 4 a layer,"
                " 6 under --ac full) over the node's links where e fits in a node, not hidden; routing taken"
                " as balanced"
            ]
            if eps
            else []
        ),
    }


def default_tps(fields: dict, per_node: int) -> tuple[int, ...]:
    """FSDP alone, and tensor parallelism over a whole node where the model divides by it (torchtitan's
    choice for its larger models: the gathers stay on NVLink)."""
    try:
        tensor_parallel.check_degree(fields, per_node)
    except UsageError:
        return (1,)
    return (1, per_node) if per_node > 1 else (1,)


def _row(
    fields: dict, work: trace.Workload, gpus: int, params: int, request: ScaleRequest, replicas: int = 1
) -> dict | str:
    dp = gpus // work.tp
    shard = dp // replicas
    layout = layout_name(replicas, shard, work.tp)
    reach = global_batch.reach(request.global_batch, request.local_batch, dp)
    if reach is None:
        return global_batch.left_out(layout, dp, request.global_batch or 0)
    one = trace.traced_at_scale(fields, replace(work, local_batch=reach.local), shard)  # over one replica's ranks
    traced = global_batch.accumulating(one, 4 * params / (work.tp * shard), reach.passes)
    timing = step_time(traced, params, fields, gpus, request, replicas, reach.passes)
    return table_row(
        request,
        gpus=gpus,
        tp=work.tp,
        replicas=replicas,
        shard=shard,
        layout=layout,
        memory=memory_columns(traced.kinds),
        peak=traced.peak,
        flops=traced.flops * reach.passes,
        collectives=tuple(
            (kind, nbytes * reach.passes, calls * reach.passes) for kind, nbytes, calls in traced.collectives
        ),
        timing=timing,
        reach=reach,
    )


def step_time(
    traced: Traced, params: int, fields: dict, gpus: int, request: ScaleRequest, replicas: int = 1, passes: int = 1
) -> dict:
    """One step's seconds: compute at the target's achieved rate, then two kinds of collectives.

    - FSDP's, over the dp_shard ranks of each tensor-parallel shard (params / tp each), unit by unit (each
      block, and the root), each its own NCCL call (plan/nccl.py) on the slower link it crosses: all-gathers
      of the parameters (forward, and again in backward, as FSDP2 reshards after forward) and a
      reduce-scatter of fp32 gradients; under HSDP, also an all-reduce of each rank's gradient shard across
      the replicas, between nodes. Overlapped with compute by prefetching except one block's share; the
      compute it overlaps runs slower for it (plan/overlap.py).
    - Tensor parallelism's, as the trace counted them: rings over the tp ranks of one node, each between two
      products that wait for it, so none is hidden (torchtitan's async TP, which overlaps them, is not
      planned).
    - `passes` forward-and-backward passes a step (gradient accumulation): each pays its compute and collectives."""
    target = request.target
    tp = gpus // (traced.world * replicas)
    compute = passes * target.compute_s(traced.flops, traced.work)
    link = target.link_for(traced.world * tp)  # a replica's ranks are consecutive: tp inside, shards around
    param_bytes = 2 if request.precision == "bf16" else 4
    units = tuple((calls, count / tp) for calls, count in fsdp_units(fields, params))
    fsdp = passes * fsdp_s(units, param_bytes, traced.world, link, replicas, target.link_for(gpus))
    blocks = fields["num_hidden_layers"]
    return fsdp_overlapped(compute, fsdp, blocks, tp=passes * collectives_s(traced, tp, target))


def recommend(rows: list[dict], request: ScaleRequest) -> str:
    """The fastest layout that fits all the planned GPUs, and the fewest GPUs that hold the step."""

    def fits(row):
        return row["fits"] and not row["tight"]

    gib = 2**30
    fitting = [r for r in rows if fits(r)] or [r for r in rows if r["fits"]]
    if not fitting:
        return (
            f"no planned layout holds the step (the smallest peak is {min(r['peak'] for r in rows) / gib:,.1f}"
            f" GiB of tensors a GPU against {request.memory_bytes / gib:,.1f} GiB);"
            + (" fuller checkpointing (--ac full), a" if request.ac != "full" else " a")
            + " shorter sequence, a smaller local batch or more tensor parallelism (--tp) lowers it"
        )
    most = max(request.counts)
    at_most = [r for r in fitting if r["gpus"] == most]
    fewest = min(fitting, key=lambda r: (r["gpus"], -r["tokens_per_s_per_gpu"]))
    held = (
        f"{fewest['layout']} over {fewest['gpus']} {request.gpu_label}GPUs is the fewest that hold the step:"
        f" {fewest['peak'] / gib:,.1f} GiB of tensors, {fewest['reserved'] / gib:,.1f} GiB reserved, of"
        f" {request.memory_bytes / gib:,.1f} GiB a GPU"
        + (" (tight: the allocator must free its cache and retry, which slows steps)" if fewest["tight"] else "")
    )
    if not at_most:
        return held
    best = max(at_most, key=lambda r: r["tokens_per_s_per_gpu"])
    return (
        f"on {most} {request.gpu_label}GPUs the fastest layout that fits is {best['layout']}:"
        f" {best['tokens_per_s_per_gpu']:,.0f} tokens/s a GPU, {best['reserved'] / gib:,.1f} GiB reserved; " + held
    )


def _refuse_weights_beyond_the_cluster(request: ScaleRequest, params: int) -> None:
    most = max(request.counts)
    weights = params * 4  # fp32 master weights
    if weights > most * request.memory_bytes:
        raise UsageError(
            f"{request.hf_config}'s {params / 1e9:,.1f} B parameters are {weights / 1e9:,.0f} GB as fp32 weights"
            f" alone, more than {most} GPUs x {request.memory_bytes / 1e9:,.0f} GB ="
            f" {most * request.memory_bytes / 1e9:,.0f} GB; training needs {TRAINING_BYTES_PER_PARAM} bytes a"
            f" parameter ({params * TRAINING_BYTES_PER_PARAM / 1e9:,.0f} GB) before activations: plan more GPUs"
            " (--nodes)"
        )


def table(document: dict):
    from rich.table import Table

    w = document["workload"]
    t = Table(
        title=f"torchfleet plan: {document['hf_config']} ({document['parameters'] / 1e9:,.1f} B),"
        f" sequence {w['seq']}, "
        + (f"global batch {w['global_batch']:,}, at most " if w.get("global_batch") else "")
        + f"local batch {w['local_batch']}, checkpointing {w['ac']}, {w['precision']},"
        f" on {document['target']} (traced on fake tensors; memory in GiB per GPU)",
        title_justify="left",
    )
    for name in (
        "GPUs",
        "layout",
        "nodes",
        "global batch",
        "at once x passes x dp",
        *COLUMNS,
        "peak/GPU",
        "reserved",
        "fits",
        "step s",
        "tokens/s/GPU",
        "bound",
    ):
        t.add_column(name, justify="left" if name in ("layout", "fits", "bound") else "right")
    for r in document["rows"]:
        t.add_row(
            str(r["gpus"]),
            r["layout"],
            str(r["nodes"]),
            f"{r['global_batch']:,}",
            r["batch"],
            *(f"{r['memory'][name] / 2**30:,.2f}" for name in COLUMNS),
            f"{r['peak'] / 2**30:,.2f}",
            f"{r['reserved'] / 2**30:,.1f}",
            "tight" if r["tight"] else "yes" if r["fits"] else "NO",
            f"{r['time']['step']:.2f}",
            f"{r['tokens_per_s_per_gpu']:,.0f}",
            r["time"]["bound"],
        )
    return t
