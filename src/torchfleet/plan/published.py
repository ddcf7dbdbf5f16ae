"""Published measured training runs, and the plan's prediction for each: the validation table's rows.

Each run is the publisher's inputs (model, GPUs, local batch, sequence, checkpointing, torch.compile, float8
linears, tensor parallelism) and its measured tokens/s a GPU, with its memory where published. The plan
reads them as `torchfleet plan --hf-config` would, with no figure fitted to any of them: every rate comes
from plan/kernels.py's cited measurements, so the leave-one-out error is the plain error.
benchmarks/validation_table.py writes the table (docs/benchmarks/validation.md); tests/plan/test_plan_validation.py
holds its summary.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from torchfleet.strategies.registry import DP_REPLICATE, PP, TP

TITAN_2412 = "torchtitan, benchmarks folder: llama3_h100_202412_torchtitan.md (Meta, Dec 2024)"
TITAN_ASYNC = "torchtitan, benchmarks folder: asyncTP_llama3_h100_2025-06_torchtitan.md (Meta, Jun 2025)"
TITAN_A100 = "torchtitan, its performance.md at c1f4345 (Meta, Oct 2024)"
TRAINY = "torchtitan, benchmarks folder: llama3-8b_h200_202506_trainy-whitefiber.md (Trainy, Jun 2025)"
FOUNDRY = "llm-foundry, scripts/train/benchmarking/README.md (MosaicML, 2023)"
AUTOMODEL = "NeMo AutoModel, docs/performance-summary.mdx (NVIDIA, 2026)"
BERT_2020 = "DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md at 78ec680 (NVIDIA, 2020)"
BERT_2022 = "DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md at a07d20a (NVIDIA, 2022)"


# What torchtitan's training.compile compiled: each block, and from April 2025 (bbb1b616e, before the June runs)
# the loss as well; the December 2024 runs' loss ran eager.
MODEL, MODEL_AND_LOSS = ("model",), ("model", "loss")


def _mpt(d_model: int, layers: int) -> dict:
    """An MPT of llm-foundry's yamls (heads of 128, vocabulary 50,368, tied embeddings) as a Llama of the
    same products: SwiGLU 8/3 as wide in place of its GELU MLP 4 times as wide, which costs the same FLOPs."""
    return {
        "model_type": "llama",
        "hidden_size": d_model,
        "intermediate_size": round(8 * d_model / 3),
        "num_hidden_layers": layers,
        "num_attention_heads": d_model // 128,
        "num_key_value_heads": d_model // 128,
        "vocab_size": 50368,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }


# Models of the runs that plan/hf_configs does not ship, by their publisher's name.
FIELDS = {
    "mpt-1b": _mpt(2048, 24),
    "mpt-3b": _mpt(2560, 32),
    "mpt-7b": _mpt(4096, 32),
    "mpt-13b": _mpt(5120, 40),
    "mpt-30b": _mpt(7168, 48),
    "mpt-70b": _mpt(8192, 80),
    # BERT-Large (bert_configs/large.json): 24 blocks of width 1024, 16 heads, feed-forward 4096, a masked
    # language model's head over 30,522 tokens.
    "bert-large": {
        "model_type": "bert",
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
        "vocab_size": 30522,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
    },
    # Qwen/Qwen3-30B-A3B's config.json: every block's MLP 128 experts, 8 a token.
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class Run:
    source: str
    model: str  # a shipped --hf-config name
    gpu: str
    gpus: int
    seq: int
    local_batch: int
    ac: str
    tokens: float  # published tokens/s a GPU
    memory_gib: float | None = None  # published memory a GPU (the allocator's reserve)
    tp: int = 1
    ep: int = 1
    global_batch: int | None = None  # where the run accumulates gradients: local batch x passes x GPUs
    attention: str = "fused"  # kernels.ATTENTION
    compile: tuple[str, ...] = ()  # what torch.compile compiled (torchtitan's compile.components)
    float8: bool = False
    ep_dispatch: str = "all-to-all"  # kernels.DISPATCH
    per_node: int = 8
    link_gbit: float = 400.0
    note: str = ""

    @property
    def publisher(self) -> str:
        """Who ran it: the source's parenthesis, up to its date."""
        return self.source.rsplit("(", 1)[1].split(",")[0]

    @property
    def inputs(self) -> str:
        parts = [f"seq {self.seq}", f"lb {self.local_batch}", f"AC {self.ac}"]
        if self.global_batch:
            parts.append(f"GA {self.global_batch // (self.local_batch * self.gpus)}")
        parts += [f"TP {self.tp}"] * (self.tp > 1) + [f"EP {self.ep}"] * (self.ep > 1)
        parts += [f"attention {self.attention}"] * (self.attention != "fused")
        parts += ["DeepEP"] * (self.ep_dispatch == "deepep")
        parts += [f"compile ({', '.join(self.compile)})"] * bool(self.compile) + ["float8"] * self.float8
        return ", ".join(parts)


def _bert(source: str, gpu: str, seq: int, micro: int, sequences_per_s: float, global_batch: int) -> Run:
    """A row of NVIDIA's BERT-Large pre-training tables: one DGX A100's 8 GPUs, their sequences/s together."""
    tokens = sequences_per_s * seq / 8
    return Run(source, "bert-large", gpu, 8, seq, micro, "none", tokens, global_batch=global_batch, attention="eager")


RUNS: tuple[Run, ...] = (
    Run(TITAN_2412, "llama-3.1-8b", "H100-HBM2E", 8, 8192, 2, "selective", 5762, 82.4),
    Run(TITAN_2412, "llama-3.1-8b", "H100-HBM2E", 8, 8192, 2, "selective", 6667, 77.0, compile=MODEL),
    Run(TITAN_2412, "llama-3.1-8b", "H100-HBM2E", 8, 8192, 2, "selective", 8532, 76.8, compile=MODEL, float8=True),
    Run(TITAN_2412, "llama-3.1-8b", "H100-HBM2E", 128, 8192, 2, "selective", 5605, 67.0),
    Run(TITAN_2412, "llama-3.1-8b", "H100-HBM2E", 128, 8192, 2, "selective", 6514, 62.0, compile=MODEL),
    Run(TITAN_2412, "llama-3.1-8b", "H100-HBM2E", 128, 8192, 2, "selective", 8380, 61.8, compile=MODEL, float8=True),
    Run(TITAN_2412, "llama-3.1-70b", "H100-HBM2E", 256, 8192, 16, "full", 829, 71.9, tp=8, compile=MODEL, float8=True),
    Run(TITAN_ASYNC, "llama-3.1-70b", "H100-HBM2E", 256, 8192, 16, "full", 597.3, tp=8, compile=MODEL_AND_LOSS),
    Run(
        TITAN_ASYNC,
        "llama-3.1-70b",
        "H100-HBM2E",
        256,
        8192,
        16,
        "full",
        809.8,
        tp=8,
        compile=MODEL_AND_LOSS,
        float8=True,
    ),
    Run(TITAN_ASYNC, "llama-3.1-8b", "H100-HBM2E", 64, 8192, 12, "selective", 4378, tp=8, compile=MODEL_AND_LOSS),
    Run(
        TITAN_ASYNC,
        "llama-3.1-8b",
        "H100-HBM2E",
        64,
        8192,
        12,
        "selective",
        5078.1,
        tp=8,
        compile=MODEL_AND_LOSS,
        float8=True,
    ),
    Run(TITAN_A100, "llama-3.1-8b", "A100", 64, 8192, 1, "selective", 2973, note="Llama 3 8B"),
    Run(TITAN_A100, "llama-3.1-70b", "A100", 64, 8192, 1, "full", 331, note="Llama 3 70B"),
    Run(TRAINY, "llama-3.1-8b", "H200", 32, 8192, 2, "selective", 10938, 47.96, compile=MODEL_AND_LOSS, float8=True),
    Run(TRAINY, "llama-3.1-8b", "H200", 64, 8192, 2, "selective", 10753, 46.97, compile=MODEL_AND_LOSS, float8=True),
    # llm-foundry's sections "H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)":
    # FSDP1 FULL_SHARD, flash attention, eager; activation checkpointing True is the whole block.
    Run(FOUNDRY, "mpt-1b", "H100", 8, 2048, 14, "none", 45455, global_batch=112),
    Run(FOUNDRY, "mpt-3b", "H100", 8, 4096, 5, "none", 20964, global_batch=240),
    Run(FOUNDRY, "mpt-7b", "H100", 8, 2048, 6, "none", 10643, global_batch=48),
    Run(FOUNDRY, "mpt-13b", "H100", 8, 2048, 2, "none", 4792, global_batch=16),
    Run(FOUNDRY, "mpt-30b", "H100", 32, 2048, 14, "full", 2308, global_batch=1344),
    Run(FOUNDRY, "mpt-70b", "H100", 64, 2048, 8, "full", 1039, global_batch=2048),
    Run(FOUNDRY, "mpt-1b", "A100", 8, 2048, 14, "none", 20513, global_batch=448, link_gbit=200),
    Run(FOUNDRY, "mpt-7b", "A100", 8, 2048, 6, "none", 4641, global_batch=96, link_gbit=200),
    Run(FOUNDRY, "mpt-13b", "A100", 8, 2048, 2, "none", 2262, global_batch=48, link_gbit=200),
    Run(FOUNDRY, "mpt-30b", "A100", 8, 2048, 3, "full", 916, global_batch=504, link_gbit=200),
    Run(FOUNDRY, "mpt-70b", "A100", 64, 2048, 8, "full", 410, global_batch=2048, link_gbit=200),
    # Pre-training on one DGX A100, "Training performance" tables (sequences/s of 8 GPUs over 8, times the
    # sequence): DDP, fp16 AMP (the A100's bf16 rate), LAMB, no checkpointing, attention by PyTorch's own
    # operators (its softmax unfused); 2020's phase 2 pads every sequence to 512 (2022's bins them by
    # length, so it is left out).
    _bert(BERT_2022, "A100", 128, 256, 4591, 65536),
    _bert(BERT_2020, "A100-40GB", 128, 64, 3231, 65536),
    _bert(BERT_2020, "A100-40GB", 512, 16, 620, 32768),
    # Pre-training, DGX-H100 BF16: FSDP2 with EP 8 (examples/llm_benchmark/qwen/qwen3_moe_30b_te_deepep.yaml).
    # Transformer Engine's attention is cuDNN's; its RMSNorm, the fused rotary and Megatron's fused SwiGLU with
    # the routing weights fuse the chains that the plan's compile fuses, so the blocks are planned compiled
    # (the loss is not: it ran eager). DeepEP dispatches and combines.
    Run(
        AUTOMODEL,
        *("qwen3-30b-a3b", "H100", 8, 4096, 4, "full", 12040),
        ep=8,
        global_batch=512,
        compile=MODEL,
        attention="cudnn",
        ep_dispatch="deepep",
    ),
)


def predict(run: Run) -> dict:
    """The plan's row for `run`: its layout, tokens/s a GPU and reserved GiB."""
    from torchfleet.plan import at_scale
    from torchfleet.plan.config import PlanConfig

    cfg = PlanConfig(
        hf_config="llama-3.1-8b" if run.model in FIELDS else run.model,
        nodes=max(1, run.gpus // run.per_node),
        gpus_per_node=min(run.gpus, run.per_node),
        gpu=run.gpu,
        link_gbit=run.link_gbit,
        precision="bf16",
        seq_len=run.seq,
        local_batch=run.local_batch,
        ac=run.ac,
        tp=(run.tp,),
        nproc=(run.gpus,),
        compile=run.compile,
        attention=run.attention,
        ep_dispatch=run.ep_dispatch,
        float8=run.float8,
        ep=(run.ep,) if run.ep > 1 else (),
        global_batch=run.global_batch,
    )
    if run.model in FIELDS:  # checked above as a shipped config's, planned with its own fields
        cfg.hf_config, cfg.library_fields = run.model, FIELDS[run.model]
    doc = at_scale.plan_at_scale(at_scale.request_of(cfg), say=lambda *_: None)
    (row,) = [
        r
        for r in doc["rows"]
        if r[TP] == run.tp and r[DP_REPLICATE] == 1 and PP not in r and ("EP" in r["layout"]) == (run.ep > 1)
    ]
    return {"layout": row["layout"], "tokens": row["tokens_per_s_per_gpu"], "memory_gib": row["reserved"] / 2**30}


def table(runs: tuple[Run, ...] = RUNS) -> list[dict]:
    """Each run with its prediction and the ratios predicted / published."""
    out = []
    for run in runs:
        p = predict(run)
        memory = p["memory_gib"] / run.memory_gib if run.memory_gib else None
        out.append({"run": run, **p, "tokens_ratio": p["tokens"] / run.tokens, "memory_ratio": memory})
    return out


def ordered_pairs(rows: list[dict], published: str, predicted: str) -> tuple[int, int, list[tuple]]:
    """Of every two runs of one source whose published figures differ, how many the plan puts in the published
    order; and the pairs it does not (a tie among them), each as its two rows."""
    right, pairs, wrong = 0, 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            seen = getattr(a["run"], published), getattr(b["run"], published)
            if a["run"].source != b["run"].source or None in seen or seen[0] == seen[1]:
                continue
            pairs += 1
            if (seen[0] > seen[1]) == (a[predicted] > b[predicted]) and a[predicted] != b[predicted]:
                right += 1
            else:
                wrong.append((a, b))
    return right, pairs, wrong


def summary(rows: list[dict]) -> dict:
    """Median and worst |predicted / published - 1|, for tokens/s and for memory where published; and how many
    comparisons inside a source come out in the published order."""

    def errors(key):
        return [abs(r[key] - 1) for r in rows if r[key] is not None]

    tokens, memory = errors("tokens_ratio"), errors("memory_ratio")
    return {
        "runs": len(rows),
        "sources": len({r["run"].publisher for r in rows}),
        "gpu_kinds": len({r["run"].gpu for r in rows}),
        "tokens_median": statistics.median(tokens),
        "tokens_worst": max(tokens),
        "memory_runs": len(memory),
        "memory_median": statistics.median(memory) if memory else None,
        "memory_worst": max(memory) if memory else None,
        "tokens_order": ordered_pairs(rows, "tokens", "tokens")[:2],
        "memory_order": ordered_pairs(rows, "memory_gib", "memory_gib")[:2],
    }
