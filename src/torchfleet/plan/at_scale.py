"""`plan --hf-config`: a library model under FSDP on a described GPU cluster, at any size: memory per GPU
and step time.

The model is never allocated: its step is traced on fake tensors
(plan/trace.py), once per checkpointing mode, and each number of GPUs reads the
same trace with its own sharding. The step's time is its traced FLOPs at one
achieved fraction of the GPU's peak, and FSDP's collectives over the link they
cross, overlapped with compute (`step_time`). Tensor and pipeline parallel
layouts are not planned by this mode yet (issue 37).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

from torchfleet.errors import UsageError
from torchfleet.plan import comm, hardware, library_model, trace

SCHEMA = "torchfleet-plan-at-scale/1"
# Bytes a parameter costs in training whatever the layout: the fp32 master weight, its fp32 gradient and
# AdamW's two fp32 moments.
TRAINING_BYTES_PER_PARAM = 16
# What the CUDA caching allocator holds (reserved) over the tensors' own peak (allocated), one figure for every
# plan: the mean of two cells measured on one H100 80GB HBM3 (torch 2.11, 27 Nov 2026), a Llama 3.2 1B-shaped
# model at sequence 8192 and local batch 2 under FSDP2 in bf16, with PYTORCH_CUDA_ALLOC_CONF=
# expandable_segments:True as torchtitan's launcher sets it: 59.56 / 53.61 GiB (1.111) with torchtitan's
# selective policy, 53.73 / 46.33 GiB (1.160) with every block recomputed. Without expandable segments the
# same cells reserved 1.207 and 1.256 times their tensors (docs/benchmarks.md). Published runs report the
# reserved figure, and a GPU runs out of memory when its reserve cannot grow.
RESERVED_OVER_ALLOCATED = 1.135
# The fraction of a GPU's dense peak that a large transformer's step reaches, on FLOPs as FlopCounterMode counts
# them (recomputation included, attention unhalved), one figure for every plan (--mfu overrides it): the mean
# of the same two H100 cells, 194.6 TFLOP in 417.6 ms (47.1% of 989.4 TFLOP/s) with the selective policy and
# 223.7 TFLOP in 455.6 ms (49.6%) with full recomputation, on one GPU, eager.
AT_SCALE_EFFICIENCY = 0.48
# The tracker's kinds, grouped as the table shows them.
COLUMNS = {
    "parameters": ("SHARDED_PARAM", "UNSHARDED_PARAM", "BUFFER"),
    "gradients": ("SHARDED_GRAD", "UNSHARDED_GRAD"),
    "optimizer": ("OPT",),
    "activations": ("ACT", "INP"),
    "temporaries": ("TEMP",),
    "comm buffers": ("ALL_GATHER", "REDUCE_SCATTER"),
}


@dataclass(frozen=True)
class ScaleRequest:
    hf_config: str
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


def request_of(cfg) -> ScaleRequest:
    """The at-scale request from plan's config (PlanConfig checked its flags) and its described cluster."""
    from torchfleet.plan.run import cluster_counts

    efficiency = AT_SCALE_EFFICIENCY if cfg.mfu is None else cfg.mfu
    target = hardware.gpu_cluster(nodes=cfg.nodes or 1, per_node=cfg.gpus_per_node or 1, gpu=cfg.gpu,
                                  tflops=cfg.tflops, memory_gb=cfg.memory_gb, mfu=efficiency,
                                  precision=cfg.precision, intra_gbit=cfg.intra_gbit, inter_gbit=cfg.link_gbit)
    return ScaleRequest(cfg.hf_config, cfg.seq_len, cfg.local_batch, cfg.ac, cfg.precision,
                        cluster_counts(cfg, target), target.per_node, target.memory_bytes, target.name,
                        f"{cfg.gpu} " if cfg.gpu else "", target, efficiency)


def plan_at_scale(request: ScaleRequest, say=print) -> dict:
    fields = library_model.read_config(request.hf_config)
    params = library_model.parameter_count(fields)
    _refuse_weights_beyond_the_cluster(request, params)
    work = trace.Workload(seq=request.seq, local_batch=request.local_batch, ac=request.ac,
                          precision=request.precision)
    say(f"tracing one training step of {request.hf_config} ({params / 1e9:,.1f} B parameters) on fake tensors:"
        f" sequence {request.seq}, local batch {request.local_batch}, checkpointing {request.ac}")
    began = time.perf_counter()
    rows = []
    for gpus in request.counts:
        traced = trace.traced_at_scale(fields, work, gpus)
        grouped = {name: sum(traced.kinds.get(k, 0.0) for k in kinds) for name, kinds in COLUMNS.items()}
        reserved = traced.peak * RESERVED_OVER_ALLOCATED
        timing = step_time(traced.flops, params, fields["num_hidden_layers"], gpus, request)
        rows.append({"gpus": gpus, "nodes": -(-gpus // request.per_node), "memory": grouped, "peak": traced.peak,
                     "flops": traced.flops, "time": timing,
                     "tokens_per_s_per_gpu": request.local_batch * request.seq / timing["step"],
                     "reserved": reserved, "fits": traced.peak <= request.memory_bytes,
                     "tight": traced.peak <= request.memory_bytes < reserved,
                     "global_batch": gpus * request.local_batch})
    fitting = [r for r in rows if r["fits"] and not r["tight"]] or [r for r in rows if r["fits"]]
    sentence = (f"FSDP over {fitting[0]['gpus']} or more {request.gpu_label}GPUs holds the step:"
                f" {fitting[0]['peak'] / 2**30:,.1f} GiB of tensors, {fitting[0]['reserved'] / 2**30:,.1f} GiB"
                f" reserved, of {request.memory_bytes / 2**30:,.1f} GiB a GPU"
                + (" (tight: the allocator must free its cache and retry, which slows steps)"
                   if fitting[0]["tight"] else "")
                if fitting else
                f"no planned count of GPUs holds the step under FSDP alone (the smallest peak is"
                f" {min(r['peak'] for r in rows) / 2**30:,.1f} GiB of tensors a GPU against"
                f" {request.memory_bytes / 2**30:,.1f} GiB);"
                + (" fuller checkpointing (--ac full), a" if request.ac != "full" else " a")
                + " shorter sequence or a smaller local batch lowers it, and so would tensor or pipeline"
                " parallelism, which --hf-config does not plan yet")
    return {"schema": SCHEMA, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "hf_config": request.hf_config, "model_type": fields["model_type"], "parameters": params,
            "workload": {"seq": request.seq, "local_batch": request.local_batch, "ac": request.ac,
                         "precision": request.precision},
            "gpu_memory_bytes": request.memory_bytes, "target": request.gpu_name, "rows": rows,
            "recommendation": sentence, "trace_s": round(time.perf_counter() - began, 1),
            "efficiency": request.efficiency, "achieved_flops_per_s": request.target.rate,
            "notes": [f"peak/GPU is the tensors' peak as FSDPMemTracker follows them on fake tensors (what"
                      f" max_memory_allocated reads on a GPU); reserved is {RESERVED_OVER_ALLOCATED} times it, the"
                      " caching allocator's measured overhead with expandable segments; a step whose tensors fit"
                      " but whose reserve does not is tight",
                      f"step time: the traced FLOPs at {request.efficiency:.0%} of the GPU's dense peak"
                      " (--mfu), and FSDP's all-gathers and reduce-scatter over the link they cross, hidden behind"
                      " compute but for one block's share"]}


def step_time(flops: float, params: int, blocks: int, gpus: int, request: ScaleRequest) -> dict:
    """One step's seconds under FSDP: compute at the target's achieved rate; all-gathers of the parameters
    (forward, and again in backward, as FSDP2 reshards after forward) and a reduce-scatter of fp32 gradients,
    rings over the GPUs on the slower link they cross; overlapped with compute by prefetching, except one
    block's share at each end of the step."""
    target = request.target
    assert target.rate is not None
    compute = flops / target.rate
    link = target.link_for(gpus)
    param_bytes = 2 if request.precision == "bf16" else 4
    gathers = 2 * comm.all_gather_s(params * param_bytes, gpus, link)
    scatter = comm.reduce_scatter_s(params * 4, gpus, link)
    communication = gathers + scatter
    exposed = communication / blocks + max(0.0, communication - compute)
    return {"step": compute + exposed, "compute": compute, "communication": communication, "exposed": exposed,
            "bound": "compute" if compute >= communication else "communication"}


def _refuse_weights_beyond_the_cluster(request: ScaleRequest, params: int) -> None:
    most = max(request.counts)
    weights = params * 4  # fp32 master weights
    if weights > most * request.memory_bytes:
        raise UsageError(
            f"{request.hf_config}'s {params / 1e9:,.1f} B parameters are {weights / 1e9:,.0f} GB as fp32 weights"
            f" alone, more than {most} GPUs x {request.memory_bytes / 1e9:,.0f} GB ="
            f" {most * request.memory_bytes / 1e9:,.0f} GB; training needs {TRAINING_BYTES_PER_PARAM} bytes a"
            f" parameter ({params * TRAINING_BYTES_PER_PARAM / 1e9:,.0f} GB) before activations: plan more GPUs"
            " (--nodes)")


def table(document: dict):
    from rich.table import Table

    w = document["workload"]
    t = Table(title=f"torchfleet plan: {document['hf_config']} ({document['parameters'] / 1e9:,.1f} B), FSDP,"
              f" sequence {w['seq']}, local batch {w['local_batch']}, checkpointing {w['ac']}, {w['precision']},"
              f" on {document['target']} (traced on fake tensors; memory in GiB per GPU)", title_justify="left")
    for name in ("GPUs", "nodes", "global batch", *COLUMNS, "peak/GPU", "reserved", "fits", "step s", "tokens/s/GPU",
                 "bound"):
        t.add_column(name, justify="left" if name in ("fits", "bound") else "right")
    for r in document["rows"]:
        t.add_row(str(r["gpus"]), str(r["nodes"]), f"{r['global_batch']:,}",
                  *(f"{r['memory'][name] / 2**30:,.2f}" for name in COLUMNS), f"{r['peak'] / 2**30:,.2f}",
                  f"{r['reserved'] / 2**30:,.1f}",
                  "tight" if r["tight"] else "yes" if r["fits"] else "NO", f"{r['time']['step']:.2f}",
                  f"{r['tokens_per_s_per_gpu']:,.0f}", r["time"]["bound"])
    return t
