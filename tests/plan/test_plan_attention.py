"""plan --hf-config's attention, held as a GPU's fused kernels hold it: no batch x heads x S x S scores, for every
variant (grouped key/value heads, DeepSeek's MLA, a sliding window, a soft cap), and the same attention as
torch's own on real tensors, forward and backward."""

from __future__ import annotations

import pytest
import torch

from helpers import require_module

require_module("transformers", "transformers (the test extra) builds the library models from configs")

from torchfleet.plan import flash_attention, trace  # noqa: E402

SEQ = 1024
HEADS = 4
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "num_hidden_layers": 2,
    "max_position_embeddings": SEQ,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
# One config per variant, at a width where one layer's fp32 scores (HEADS x SEQ x SEQ x 4 bytes, 16 MiB) outweigh
# everything else a step holds.
VARIANTS = {
    "gqa": {**SMALL, "model_type": "llama"},
    "mla": {
        **SMALL,
        "model_type": "deepseek_v2",
        "num_key_value_heads": HEADS,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "sliding-window": {**SMALL, "model_type": "mistral", "sliding_window": 128},
    "soft-cap": {
        **SMALL,
        "model_type": "gemma2",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 128,
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_traced_step_holds_no_score_matrix(variant):
    """The whole step's peak, every kind of tensor, stays below one layer's fp32 scores: the CPU's own attention
    kept them for MLA (value heads narrower than the query's), a sliding window and a soft cap (16 MiB a layer
    here; 220 GiB of temporaries for DeepSeek-V2-Lite at sequence 8192)."""
    traced = trace.trace(VARIANTS[variant], trace.Workload(seq=SEQ, local_batch=1, ac="none"), 8)
    scores = HEADS * SEQ * SEQ * 4
    print(f"{variant}: peak {traced.peak / 2**20:.2f} MiB, one layer's scores {scores / 2**20:.0f} MiB")
    assert 0 < traced.peak < scores, traced.kinds
    assert traced.flops > 0


def _reference(q, k, v, scale, causal, window, softcap):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows, cols = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        allowed &= cols <= rows
    if window:
        allowed &= rows - cols < window
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize(
    "causal, window, softcap, v_width",
    [(True, 0, 0.0, 8), (False, 0, 0.0, 8), (True, 4, 0.0, 8), (True, 0, 5.0, 8), (True, 4, 5.0, 6)],
    ids=["causal", "encoder", "window", "soft-cap", "window-cap-mla"],
)
def test_the_operator_computes_attention_and_its_gradients(causal, window, softcap, v_width):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 16, v_width, dtype=torch.float64, requires_grad=True)
    out, lse = flash_attention.attention(q, k, v, 0.35, causal, window, softcap)
    expected = _reference(q, k, v, 0.35, causal, window, softcap)
    assert lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    assert torch.allclose(out, expected, atol=1e-5)
    grad = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad), strict=True
    ):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
