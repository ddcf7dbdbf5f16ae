"""The at-scale plan's achievable efficiency, fitted to the GPU cells measured (issue 37).

    python benchmarks/roofline_fit.py

Each cell is one GPU's step that `benchmarks/scale_probe.py` measured on an H100 and an H200
(docs/benchmarks, "Real steps at width"): a Llama shape at sequence 8192, local batch 2, under FSDP2
on a one-rank group, bf16 compute with fp32 master weights, fused AdamW. Here each is traced as the
plan traces it (plan/trace.py, fake tensors, a one-rank fake group) and priced two ways:

    FLOPs only   the traced FLOPs at the GPU's dense bf16 peak; efficiency = that time / the measured
    roofline     the same, plus the bytes the memory-bound operators move and a fused AdamW's 28 bytes a
                 parameter at the GPU's memory bandwidth (plan/scale_rows.compute_s);
                 efficiency = that time / the measured

The plan uses one efficiency for both terms, the H100 cells' mean (plan/at_scale.AT_SCALE_EFFICIENCY).
The spread of each way's efficiencies over the cells says how much of the step time the way explains.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# Shapes of scale_probe.py's cells: hidden, heads, key/value heads, feed-forward width, vocabulary, head width.
SHAPES = {
    "1B": (2048, 32, 8, 8192, 128256, 64),
    "8B": (4096, 32, 8, 14336, 128256, 128),
    "70B tp 8 share": (8192, 8, 1, 3584, 16032, 128),  # one GPU's share under tp 8: heads, width, vocabulary / 8
    "405B tp 8 share": (16384, 16, 1, 6656, 16032, 128),
}
# (shape, blocks, checkpointing, H100 ms, H200 ms): scale_probe.py's medians, 27 Nov 2026 (the fourth GPU run,
# docs/benchmarks/history.md; 1B with full checkpointing: the second run's H100 cell). The H100's 8B at 8 blocks
# is left out: the allocator freed its cache and retried 12 times a run there.
CELLS = [
    ("1B", 16, "selective", 420.8, 395.1),
    ("1B", 16, "full", 455.6, None),
    ("8B", 2, "selective", 245.6, None),
    ("8B", 4, "selective", 360.7, 336.3),
    ("8B", 6, "selective", 473.5, None),
    ("8B", 8, "selective", None, 561.5),
    ("8B", 4, "full", None, 367.3),
    ("70B tp 8 share", 4, "full", 150.7, 139.7),
    ("405B tp 8 share", 2, "full", None, 240.5),
    ("405B tp 8 share", 4, "full", 441.2, 427.6),
]


def fields_of(shape: str, blocks: int) -> dict:
    from torchfleet.plan import library_model

    hidden, heads, kv, ffn, vocab, head = SHAPES[shape]
    return {
        **library_model.read_config("llama-3.1-8b"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "head_dim": head,
        "num_hidden_layers": blocks,
        "tie_word_embeddings": False,
    }


def main() -> None:
    from torchfleet.plan import hardware, library_model, trace
    from torchfleet.plan.scale_rows import FUSED_ADAMW_BYTES_PER_PARAM

    gpus = {name: (hardware.GPUS[name][0] * 1e12, hardware.GPUS[name][4] * 1e12) for name in ("H100", "H200")}
    found: dict[str, dict[str, list[float]]] = {g: {"flops": [], "roofline": []} for g in gpus}
    print("| cell | checkpointing | TFLOP | GB moved | GPU | measured | FLOPs-only efficiency | roofline efficiency |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for shape, blocks, ac, *measured in CELLS:
        fields = fields_of(shape, blocks)
        start = time.perf_counter()
        traced = trace.trace(fields, trace.Workload(seq=8192, local_batch=2, ac=ac), 1, blocks)
        params = library_model.parameter_count(fields)
        moved = traced.traffic + FUSED_ADAMW_BYTES_PER_PARAM * params
        for (gpu, (peak, hbm)), ms in zip(gpus.items(), measured, strict=True):
            if ms is None:
                continue
            flops_only = traced.flops / peak / (ms / 1e3)
            roofline = (traced.flops / peak + moved / hbm) / (ms / 1e3)
            found[gpu]["flops"].append(flops_only)
            found[gpu]["roofline"].append(roofline)
            print(
                f"| {shape}, {blocks} blocks | {ac} | {traced.flops / 1e12:.1f} | {moved / 1e9:.0f} | {gpu} | {ms} ms"
                f" | {flops_only:.1%} | {roofline:.1%} |",
                flush=True,
            )
        print(f"  (traced in {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    for gpu, ways in found.items():
        for way, values in ways.items():
            print(
                f"{gpu} {way}: mean {statistics.mean(values):.1%}, from {min(values):.1%} to {max(values):.1%}"
                f" ({max(values) - min(values):.1%} apart) over {len(values)} cells"
            )


if __name__ == "__main__":
    main()
