"""A small Mixtral from its config, for `torchfleet plan --model tests/small_moe.py:mixtral` (bench's
MODULE:FUNCTION): transformers' own mixture-of-experts layers at their defaults, only the sizes small."""

from __future__ import annotations

import torch
from torch.nn import functional as F

VOCAB, SEQ = 64, 16
EXPERTS, TOP_K, HIDDEN, LAYERS = 4, 2, 32, 2


def mixtral():
    """(model, make_batch, loss_fn) as bench takes them: SEQ tokens a sample, the next token as the target."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mixtral",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=SEQ,
    )
    return AutoModelForCausalLM.from_config(config), _tokens, _loss


def _tokens(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(output, targets):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
