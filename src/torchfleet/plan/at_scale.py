"""`plan --hf-config`: memory per GPU of a library model under FSDP on a described GPU cluster, at any size.

The model is never allocated: its step is traced on fake tensors
(plan/trace.py), once per checkpointing mode, and each number of GPUs reads the
same trace with its own sharding. What bounds the step's time at scale (the
roofline of the traced operators and the collectives over a two-level
topology) is not predicted by this mode yet: issue 37 tracks it.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

from torchfleet.errors import UsageError
from torchfleet.plan import library_model, trace

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
    gpu_name: str


def request_of(cfg) -> ScaleRequest:
    """The at-scale request from plan's config and its described cluster; bad values are one sentence."""
    from torchfleet.config import at_least
    from torchfleet.plan.run import cluster_counts, target_of

    if cfg.cpus_per_node is not None or not (cfg.gpus_per_node or cfg.gpu or cfg.tflops):
        raise UsageError("--hf-config plans a described GPU cluster: give --gpus-per-node with --gpu (or --tflops"
                         " and --memory-gb), and --nodes for more than one machine")
    target = target_of(cfg, None)
    if cfg.check:
        raise UsageError("--check runs the model here, which --hf-config's models are too big for; leave out one")
    if cfg.ac not in trace.AC_MODES:
        raise UsageError(f"--ac {cfg.ac!r} is not a checkpointing mode; choose one of {', '.join(trace.AC_MODES)}")
    if cfg.precision not in ("bf16", "fp32"):
        raise UsageError(f"--precision {cfg.precision} is not planned at scale; choose bf16 (bf16 compute, fp32"
                         " master weights and reduction, as torchtitan trains) or fp32")
    at_least("--seq-len", cfg.seq_len, 1)
    at_least("--local-batch", cfg.local_batch, 1)
    return ScaleRequest(cfg.hf_config, cfg.seq_len, cfg.local_batch, cfg.ac, cfg.precision,
                        cluster_counts(cfg, target), target.per_node, target.memory_bytes, target.name)


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
        rows.append({"gpus": gpus, "nodes": -(-gpus // request.per_node), "memory": grouped, "peak": traced.peak,
                     "reserved": reserved, "fits": traced.peak <= request.memory_bytes,
                     "tight": traced.peak <= request.memory_bytes < reserved,
                     "global_batch": gpus * request.local_batch})
    fitting = [r for r in rows if r["fits"] and not r["tight"]] or [r for r in rows if r["fits"]]
    sentence = (f"FSDP over {fitting[0]['gpus']} or more {request.gpu_name.split(' ')[-1]} GPUs holds the step:"
                f" {fitting[0]['peak'] / 2**30:,.1f} GiB of tensors, {fitting[0]['reserved'] / 2**30:,.1f} GiB"
                f" reserved, of {request.memory_bytes / 2**30:,.1f} GiB a GPU"
                + (" (tight: the allocator must free its cache and retry, which slows steps)"
                   if fitting[0]["tight"] else "")
                if fitting else
                f"no planned count of GPUs holds the step under FSDP alone (the smallest peak is"
                f" {min(r['peak'] for r in rows) / 2**30:,.1f} GiB of tensors a GPU against {request.memory_bytes / 2**30:,.1f});"
                + (" fuller checkpointing (--ac full), a" if request.ac != "full" else " a")
                + " shorter sequence or a smaller local batch lowers it, and so would tensor or pipeline"
                " parallelism, which --hf-config does not plan yet")
    return {"schema": SCHEMA, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "hf_config": request.hf_config, "model_type": fields["model_type"], "parameters": params,
            "workload": {"seq": request.seq, "local_batch": request.local_batch, "ac": request.ac,
                         "precision": request.precision},
            "gpu_memory_bytes": request.memory_bytes, "target": request.gpu_name, "rows": rows,
            "recommendation": sentence, "trace_s": round(time.perf_counter() - began, 1),
            "notes": [f"peak/GPU is the tensors' peak as FSDPMemTracker follows them on fake tensors (what"
                      f" max_memory_allocated reads on a GPU); reserved is {RESERVED_OVER_ALLOCATED} times it, the"
                      " caching allocator's measured overhead with expandable segments; a step whose tensors fit but whose"
                      " reserve does not is tight",
                      "step time at scale is not predicted by --hf-config yet"]}


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
              f" on {document['target']} (memory per GPU, traced on fake tensors)", title_justify="left")
    for name in ("GPUs", "nodes", "global batch", *COLUMNS, "peak/GPU", "reserved", "fits"):
        t.add_column(name, justify="left" if name == "fits" else "right")
    for r in document["rows"]:
        t.add_row(str(r["gpus"]), str(r["nodes"]), f"{r['global_batch']:,}",
                  *(f"{r['memory'][name] / 2**30:,.2f}" for name in COLUMNS), f"{r['peak'] / 2**30:,.2f} GiB",
                  f"{r['reserved'] / 2**30:,.1f} GiB",
                  "tight" if r["tight"] else "yes" if r["fits"] else "NO")
    return t
