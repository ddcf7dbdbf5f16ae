"""Ground truth for planning at scale, measured on one GPU (issue 37), and the padded-vocabulary cell (issue 41).

    python benchmarks/scale_probe.py --out /tmp/probe          # on the GPU machine, about 5 minutes
    python benchmarks/scale_probe.py --out /tmp/probe --dry-run  # tiny cells on this CPU: checks the script

Two parts, each cell in its own process (an out-of-memory or a crash costs that cell only), each
writing one JSON line to OUT/cells.jsonl:

- `real`: a Llama-shaped model (written here: RMSNorm, rotary attention with grouped key/value heads,
  SwiGLU) trained for a few steps under FSDP2 on a one-rank group, bf16 parameters with fp32 reduction
  and fp32 master weights (MixedPrecisionPolicy), AdamW, activation checkpointing none, every other
  block ("sel2") or every block ("full"). It records max_memory_allocated, the median step and the
  step's FLOPs (FlopCounterMode).
- `fake`: the same cells never allocated: FakeTensorMode on the same device, a fake process group,
  FSDPMemTracker's peak and RuntimeEstimator's roofline time. The planner at scale will stand on
  these two tools; this says how far each is from the real step.
- `vocab`: the gpt2 preset at batch 32 in bf16 autocast, vocabulary 50,257 against 50,304 (a
  multiple of 64), eager and compiled: the first GPU run found 46% of the step in the output
  layer's unaligned kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
GIB = 2**30


@dataclass(frozen=True)
class Llama:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    head: int = 0  # the head's width where it is not dim / heads: a tensor-parallel shard keeps 128

    @property
    def head_dim(self) -> int:
        return self.head or self.dim // self.heads


# Llama 3.2 1B and 3B's public shapes (untied output layer here, as Llama 3.1's larger models have).
SHAPES = {
    "1b": Llama(2048, 16, 32, 8, 8192),
    "3b": Llama(3072, 28, 24, 8, 8192),
    "8b": Llama(4096, 32, 32, 8, 14336),
    "tiny": Llama(64, 4, 4, 2, 128, vocab=512),
    # One GPU's share of Llama 3.1 70B and 405B under tp 8 as torchtitan lays them out: heads, the feed-forward
    # width and the vocabulary split eight ways, the model width whole. Their steps' speed says whether the
    # planner's one efficiency holds for the shapes the at-scale layouts give each GPU.
    "70b-tp8": Llama(8192, 80, 8, 1, 3584, vocab=16032, head=128),
    "405b-tp8": Llama(16384, 126, 16, 1, 6656, vocab=16032, head=128),
    "tiny-tp2": Llama(64, 4, 2, 1, 64, vocab=256, head=16),
}


def shape_of(name: str) -> Llama:
    """`8b` is the whole shape; `8b@4` keeps its first four blocks, so a wide model's step fits one GPU."""
    base, _, layers = name.partition("@")
    return replace(SHAPES[base], layers=int(layers)) if layers else SHAPES[base]


# (shape, sequence, local batch, checkpointing)
CELLS = [
    ("1b", 8192, 2, "none"),
    ("1b", 8192, 2, "sel2"),
    ("1b", 8192, 2, "full"),
    ("3b", 8192, 1, "full"),
    ("3b", 4096, 2, "sel2"),
]
DRY_CELLS = [("tiny", 64, 2, "none"), ("tiny", 64, 2, "full"), ("tiny-tp2@2", 64, 2, "full")]
# Fake only, as torchtitan's published Llama 3.1 8B run: FSDP over 8 GPUs (shape, sequence, local batch, checkpointing, world).
FAKE_ONLY = [("8b", 8192, 2, "sel2", 8), ("8b", 8192, 2, "full", 8)]


def build(shape: Llama, seq: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            hd = shape.head_dim
            self.wq = nn.Linear(shape.dim, shape.heads * hd, bias=False)
            self.wk = nn.Linear(shape.dim, shape.kv_heads * hd, bias=False)
            self.wv = nn.Linear(shape.dim, shape.kv_heads * hd, bias=False)
            self.wo = nn.Linear(shape.heads * hd, shape.dim, bias=False)

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            hd = shape.head_dim
            q = self.wq(x).view(b, s, shape.heads, hd).transpose(1, 2)
            k = self.wk(x).view(b, s, shape.kv_heads, hd).transpose(1, 2)
            v = self.wv(x).view(b, s, shape.kv_heads, hd).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            repeat = shape.heads // shape.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def rotate(t, cos, sin):
        half = t.shape[-1] // 2
        a, b = t[..., :half], t[..., half:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(t.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm = nn.RMSNorm(shape.dim, eps=1e-5)
            self.attention = Attention()
            self.ffn_norm = nn.RMSNorm(shape.dim, eps=1e-5)
            self.w1 = nn.Linear(shape.dim, shape.ffn, bias=False)
            self.w2 = nn.Linear(shape.ffn, shape.dim, bias=False)
            self.w3 = nn.Linear(shape.dim, shape.ffn, bias=False)

        def forward(self, x, cos, sin):
            x = x + self.attention(self.attention_norm(x), cos, sin)
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(shape.vocab, shape.dim)
            self.layers = nn.ModuleList(Block() for _ in range(shape.layers))
            self.norm = nn.RMSNorm(shape.dim, eps=1e-5)
            self.output = nn.Linear(shape.dim, shape.vocab, bias=False)
            inv = 1.0 / (500000.0 ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
            angles = torch.outer(torch.arange(seq).float(), inv)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, tokens):
            x = self.tok_embeddings(tokens)
            for layer in self.layers:
                x = layer(x, self.cos, self.sin)
            return self.output(self.norm(x))

    return Model()


def prepare(model, ac: str, mesh):
    """FSDP2 over every block and the root, bf16 compute with fp32 reduction; checkpointing as `ac` says."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for i, block in enumerate(model.layers):
        if ac == "full" or (ac == "sel2" and i % 2 == 0):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif ac == "selective":  # torchtitan's operator policy, as plan --hf-config traces it
            from torchfleet.plan.checkpoint_policy import selective_contexts

            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=selective_contexts)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def step(model, optimizer, tokens):
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def run_real(cell: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device(cell["device"])
    shape, seq, batch = shape_of(cell["shape"]), cell["seq"], cell["batch"]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29533"
    )
    torch.manual_seed(0)
    with device:
        model = build(shape, seq)
    params = sum(p.numel() for p in model.parameters())
    model = prepare(model, cell["ac"], init_device_mesh(device.type, (1,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, shape.vocab, (batch, seq + 1), device=device)
    times, flops = [], None
    for i in range(cell["warmup"] + cell["steps"]):
        if i == cell["warmup"]:
            with FlopCounterMode(display=False) as counter:
                step(model, optimizer, tokens)
            flops = counter.get_total_flops()
            continue
        sync(device)
        began = time.perf_counter()
        loss = step(model, optimizer, tokens)
        sync(device)
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    # What torchtitan's published tables report: the caching allocator's reserved peak, not the tensors'.
    reserved = torch.cuda.max_memory_reserved() if device.type == "cuda" else None
    # A step near the card's capacity makes the allocator free its cache and retry: slower, and not the model's speed.
    retries = torch.cuda.memory_stats().get("num_alloc_retries") if device.type == "cuda" else None
    dist.destroy_process_group()
    return {
        "params": params,
        "peak_gib": peak and peak / GIB,
        "reserved_gib": reserved and reserved / GIB,
        "step_ms": 1e3 * statistics.median(times),
        "flops": flops,
        "alloc_retries": retries,
        "tokens_per_s": batch * seq / statistics.median(times),
        "loss": float(loss),
    }


def run_fake(cell: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device(cell["device"])
    shape, seq, batch = shape_of(cell["shape"]), cell["seq"], cell["batch"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cell.get("world", 1))
    mesh = init_device_mesh(device.type, (cell.get("world", 1),))  # outside fake mode: it reads its ranks
    out: dict = {}
    began = time.perf_counter()
    with FakeTensorMode():
        with device:
            model = build(shape, seq)
        model = prepare(model, cell["ac"], mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        tokens = torch.randint(0, shape.vocab, (batch, seq + 1), device=device)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((tokens,))
        with tracker:
            for i in range(2):  # the second step holds the optimizer's state from the first
                step(model, optimizer, tokens)
                if i == 0:
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
        # The H200 run (torch 2.11) found a second device in this snapshot besides cuda:0, holding optimizer
        # state only, 16 bytes a parameter and unsharded; the cuda:0 entry alone matched max_memory_allocated.
        out["fake_peak_gib"] = sum(d.get("Total", 0) for d in peak.values()) / GIB
        out["fake_peak_by_device_gib"] = {
            str(dev): {str(k).split(".")[-1]: v / GIB for k, v in d.items() if v} for dev, d in peak.items()
        }
        if device.type == "cuda":
            # The roofline refuses an operator with two output dtypes (fused attention's bf16 output and fp32
            # log-sum-exp): the math backend's matrix products count the same FLOPs in single-dtype operators.
            from torch.nn.attention import SDPBackend, sdpa_kernel

            try:
                estimator = RuntimeEstimator()
                with sdpa_kernel(SDPBackend.MATH), estimator("operator-level-cost-model"):
                    step(model, optimizer, tokens)
                out["roofline_ms"] = estimator.total_runtime
            except Exception as exc:  # noqa: BLE001 (the memory figure above still counts)
                out["roofline_error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["seconds"] = time.perf_counter() - began
    dist.destroy_process_group()
    return out


def run_vocab(cell: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from torchfleet.models.gpt import GPT, gpt_config

    device = torch.device(cell["device"])
    config = replace(gpt_config(cell["preset"]), vocab_size=cell["vocab"])
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cell["vocab"], (cell["batch"], config.block_size + 1), device=device)
    forward = torch.compile(model) if cell["compiled"] else model

    def train_step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, first = [], None
    for i in range(cell["warmup"] + cell["steps"]):
        sync(device)
        began = time.perf_counter()
        train_step()
        sync(device)
        if i == 0:
            first = time.perf_counter() - began
        if i >= cell["warmup"]:
            times.append(time.perf_counter() - began)
    with FlopCounterMode(display=False) as counter:
        train_step()
    return {"step_ms": 1e3 * statistics.median(times), "first_step_s": first, "flops": counter.get_total_flops()}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def child(cell: dict) -> None:
    run = {"real": run_real, "fake": run_fake, "vocab": run_vocab}[cell["part"]]
    try:
        cell.update(run(cell))
    except Exception as exc:  # noqa: BLE001 (a failed cell is a row saying why, and the others still run)
        cell["error"] = f"{type(exc).__name__}: {exc}"[:600]
    print("CELL " + json.dumps(cell), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--only", default="real,fake,vocab", help="parts, in the order they run")
    parser.add_argument(
        "--cells",
        default=None,
        help="only these real/fake cells, as SHAPE:SEQ:BATCH:AC separated by commas (1b:8192:2:selective)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    info = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (args.out / "info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info), flush=True)
    cells = []
    for part in args.only.split(","):
        if part == "vocab":
            for compiled in (False, True):
                for vocab in (50257, 50304):
                    cells.append(
                        {
                            "part": "vocab",
                            "preset": "tiny" if args.dry_run else "gpt2",
                            "vocab": vocab,
                            "batch": 2 if args.dry_run else 32,
                            "compiled": compiled,
                            "warmup": 3,
                            "steps": 2 if args.dry_run else 10,
                        }
                    )
            continue
        chosen = DRY_CELLS if args.dry_run else CELLS
        if args.cells:
            chosen = [(a, int(b), int(c), d) for a, b, c, d in (cell.split(":") for cell in args.cells.split(","))]
        for shape, seq, batch, ac in chosen:
            cells.append(
                {
                    "part": part,
                    "shape": shape,
                    "seq": seq,
                    "batch": batch,
                    "ac": ac,
                    "warmup": 2,
                    "steps": 2 if args.dry_run else 5,
                }
            )
        if part == "fake" and not args.cells:
            for shape, seq, batch, ac, world in [("tiny", 64, 2, "full", 8)] if args.dry_run else FAKE_ONLY:
                cells.append({"part": part, "shape": shape, "seq": seq, "batch": batch, "ac": ac, "world": world})
    with (args.out / "cells.jsonl").open("a") as sink:
        for cell in cells:
            cell["device"] = device
            began = time.monotonic()
            try:
                done = subprocess.run(
                    [sys.executable, __file__, "--out", str(args.out), "--child", json.dumps(cell)],
                    capture_output=True,
                    text=True,
                    timeout=240,
                )
                rows = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("CELL ")]
                row = rows[-1] if rows else {**cell, "error": f"exit {done.returncode}: {done.stderr[-600:]}"}
            except subprocess.TimeoutExpired:
                row = {**cell, "error": "timed out after 240 s"}
            row["wall_s"] = round(time.monotonic() - began, 1)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            print(summary(row), flush=True)


def summary(row: dict) -> str:
    name = " ".join(
        str(row.get(k))
        for k in ("part", "shape", "preset", "vocab", "compiled", "seq", "batch", "ac", "world")
        if k in row
    )
    if "error" in row:
        return f"{name}: ERROR {row['error'][:300]}"
    figures = {
        k: (round(v, 3) if isinstance(v, float) else v)
        for k, v in row.items()
        if k
        in (
            "peak_gib",
            "reserved_gib",
            "step_ms",
            "tokens_per_s",
            "fake_peak_gib",
            "roofline_ms",
            "first_step_s",
            "wall_s",
            "flops",
            "params",
            "alloc_retries",
        )
    }
    return f"{name}: {figures}"


if __name__ == "__main__":
    main()
