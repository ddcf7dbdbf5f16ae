"""A pipeline stage's real peak on one GPU against `plan --pp`'s traced stage (issue 37).

    python benchmarks/stage_probe.py --out DIR                 # on the GPU machine: Llama 3.1 8B at pp 4
    python benchmarks/stage_probe.py --out DIR --dry-run       # a tiny Llama on this CPU: checks the script
    python benchmarks/stage_probe.py --predict DIR             # afterwards, on any machine: the plan beside it
    python benchmarks/stage_probe.py --predict DIR --fake-schedule   # and the same schedule on fake tensors
    python benchmarks/stage_probe.py --out DIR --snapshot      # on the GPU: also the allocator's history per stage

One process holds one GPU's stage of a pp-stage pipeline: the first (the token embedding and its share of
the blocks) or the last (its share, the final norm and the output layer). FSDP2 on a one-rank group lays it
out as the plan does (bf16 compute, fp32 master weights and reduction, parameters kept gathered through the
step, gradients accumulated unsharded until the last micro-batch, as torch's PipelineStage drives it), and
it runs its micro-batches in 1F1B's order for its place: the first GPU pp forwards ahead, the last one. The
neighbours' sends are stood in for: the first stage's output gradients are ones, the last stage's inputs
random hidden states. max_memory_allocated, less what was allocated before the stage was built, is the peak; one JSON line per stage goes to DIR/stages.jsonl.

`--fake-schedule` runs the very same schedule on this CPU under fake tensors (a fake one-rank group,
FSDPMemTracker's peak, its module statistics reset before each forward, since it tracks one pass at a
time). Where that agrees with `plan` but not with the GPU, the difference is something tracing cannot
see (the allocator, FSDP2's streams), not the schedule. `--snapshot` records the CUDA allocator's history
(torch.cuda.memory._record_memory_history) and writes DIR/snapshot-<role>-<pp>-<m>-<ac>.pickle, which
pytorch.org/memory_viz draws: what is alive at the peak, and which line allocated it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
GIB = 2**30


def run_stage(
    fields: dict, role: str, pp: int, microbatches: int, seq: int, ac: str, device: str, tracker_class=None, mesh=None
) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchfleet.plan import library_model, trace

    blocks = fields["num_hidden_layers"] // pp
    # What an earlier stage in this process left allocated is not this stage's: about 8.5 GiB stayed after
    # each 8B stage, which inflated every cell after the first in the 27 Nov runs. The peak is counted from here.
    gc.collect()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    stage_fields = {**fields, "num_hidden_layers": blocks}
    mesh = mesh or init_device_mesh(device, (1,))
    work = trace.Workload(seq=seq, local_batch=1, ac=ac, reshard_after_forward=False, stage=role)
    with torch.device(device):
        model = library_model.build(stage_fields)
    library_model.keep_stage(model, role)
    trace._prepare(model, stage_fields, work, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    trace._make_optimizer_state(model, optimizer)
    tracker = tracker_class(model, optimizer) if tracker_class else contextlib.nullcontext()
    rank = 0 if role == "first" else pp - 1
    warm = min(microbatches, pp - rank)
    order = ["F"] * warm + ["B", "F"] * (microbatches - warm) + ["B"] * warm
    tokens = torch.randint(0, fields["vocab_size"], (microbatches, 1, seq + 1), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with tracker:
        _run_order(model, optimizer, order, tokens, fields, role, seq, device, microbatches, tracker)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    if tracker_class:
        peak = max(sum(kinds.values()) for kinds in tracker.moments)
    dist.barrier()
    return {
        "role": role,
        "pp": pp,
        "blocks": blocks,
        "microbatches": microbatches,
        "seq": seq,
        "ac": ac,
        "held": warm,
        "peak": peak,
        "left_before": base,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }


def _run_order(model, optimizer, order, tokens, fields, role, seq, device, microbatches, tracker) -> None:
    import torch
    import torch.nn.functional as F

    held, done, f = [], 0, 0
    for step in order:
        if step == "F":
            if hasattr(tracker, "reset_mod_stats"):
                tracker.reset_mod_stats()  # FSDPMemTracker follows one pass at a time; its peak stays
            if role == "first":
                out = model(input_ids=tokens[f][:, :-1], use_cache=False).logits
            else:
                x = torch.randn(1, seq, fields["hidden_size"], dtype=torch.bfloat16, device=device, requires_grad=True)
                out = F.cross_entropy(
                    model(inputs_embeds=x, use_cache=False).logits.flatten(0, 1).float(), tokens[f][:, 1:].flatten()
                )
            held.append(out)
            f += 1
            continue
        out = held.pop(0)
        done += 1
        final = done == microbatches
        model.set_is_last_backward(final)
        model.set_reshard_after_backward(final)
        model.set_requires_gradient_sync(final)
        out.backward(torch.ones_like(out) if role == "first" else None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def predict(fields: dict, row: dict) -> float:
    from torchfleet.plan import library_model, pipeline_at_scale, pipelines, trace

    stage_fields = {**fields, "num_hidden_layers": row["blocks"]}
    kept = trace.Workload(seq=row["seq"], local_batch=1, ac=row["ac"], reshard_after_forward=False)
    held = (
        pipelines.activations_held("1f1b", row["pp"], row["microbatches"]) * row["pp"]
        if row["role"] == "first"
        else pipelines.held_by_last("1f1b", row["pp"], row["microbatches"])
    )
    params = library_model.parameter_count(fields)
    parameters = pipeline_at_scale.stage_parameters(fields, params, row["pp"], row["role"])
    _, memory = pipeline_at_scale._stage(stage_fields, kept, 1, row["role"], held, parameters, row["microbatches"])
    return sum(memory.values())


def fake_schedule(fields: dict, row: dict) -> float:
    """The peak of `row`'s stage and schedule run on fake tensors here, as FSDPMemTracker counts it."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchfleet.plan import trace

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = trace._mesh(1, 1)  # outside fake mode: it reads its ranks
        with FakeTensorMode():
            got = run_stage(
                fields,
                row["role"],
                row["pp"],
                row["microbatches"],
                row["seq"],
                row["ac"],
                "cpu",
                trace._timeline_tracker(),
                mesh,
            )
    finally:
        dist.destroy_process_group()
    return got["peak"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/stage-probe")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--predict", metavar="DIR", default=None)
    parser.add_argument("--cells", default="4:8:selective", help="PP:MICROBATCHES:AC, comma-separated")
    parser.add_argument("--fake-schedule", action="store_true", help="with --predict: the schedule on fake tensors")
    parser.add_argument("--snapshot", action="store_true", help="on the GPU: the allocator's history per stage")
    args = parser.parse_args()
    from torchfleet.plan import library_model

    fields = library_model.read_config("llama-3.1-8b")
    if args.dry_run:
        fields = {
            **fields,
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "num_hidden_layers": 8,
        }
    if args.predict:
        for line in (Path(args.predict) / "stages.jsonl").read_text().splitlines():
            row = json.loads(line)
            guess = predict(fields, row)
            fake = f", fake schedule {fake_schedule(fields, row) / GIB:.2f} GiB" if args.fake_schedule else ""
            print(
                f"{row['role']:5} pp {row['pp']} blocks {row['blocks']} m {row['microbatches']} held {row['held']}"
                f" {row['ac']}: measured {row['peak'] / GIB:.2f} GiB, predicted {guess / GIB:.2f} GiB,"
                f" ratio {guess / row['peak']:.3f}{fake}"
                if row["peak"]
                else f"{row['role']}: no GPU peak",
                flush=True,
            )
        return
    import os

    import torch
    import torch.distributed as dist

    device = "cpu" if args.dry_run else "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seq = 256 if args.dry_run else 8192
    with (out / "stages.jsonl").open("a") as fh:
        for cell in args.cells.split(","):
            pp, m, ac = cell.split(":")
            for role in ("first", "last"):
                recording = args.snapshot and device == "cuda"
                if recording:
                    torch.cuda.memory._record_memory_history(
                        stacks="python", max_entries=2_000_000
                    )  # C++ stacks take minutes to dump
                row = run_stage(fields, role, int(pp), int(m), seq, ac, device)
                if recording:
                    torch.cuda.memory._dump_snapshot(str(out / f"snapshot-{role}-{pp}-{m}-{ac}.pickle"))
                    torch.cuda.memory._record_memory_history(enabled=None)
                print(json.dumps(row), flush=True)
                fh.write(json.dumps(row) + "\n")
                if device == "cuda":
                    torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
