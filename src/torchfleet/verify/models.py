"""What `torchfleet verify` trains: a shrunk Hugging Face config, or the user's MODULE:FUNCTION.

A `Source` is a picklable description that every process builds alike (after the same seed): the config's
fields, or the function's name. Shrinking keeps the architecture (model type, attention kind, norms, tied
or untied head, experts and their routing) and makes every size small: `layers` decoder blocks, `width`
hidden features, 4 attention heads (2 key-value heads where the model groups them), 4 experts of which 2
per token, and a vocabulary of 128. Dropout is set to 0: each strategy draws its own dropout masks, so a
strategy with dropout computes another function than serial, by design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from torchfleet.errors import UsageError

SEQ, VOCAB = 16, 128
# The fields a config may carry and what each becomes (a callable of (value, layers, width), or a value).
_SIZES: dict[str, Callable[[int, int, int], int]] = {
    "num_hidden_layers": lambda v, layers, w: layers,
    "hidden_size": lambda v, layers, w: w,
    "intermediate_size": lambda v, layers, w: 2 * w,
    "moe_intermediate_size": lambda v, layers, w: w,
    "shared_expert_intermediate_size": lambda v, layers, w: 2 * w,
    "num_attention_heads": lambda v, layers, w: 4,
    "head_dim": lambda v, layers, w: w // 4,
    "vocab_size": lambda v, layers, w: VOCAB,
    "num_local_experts": lambda v, layers, w: min(v, 4),
    "num_experts": lambda v, layers, w: min(v, 4),
    "n_routed_experts": lambda v, layers, w: min(v, 4),
    "num_experts_per_tok": lambda v, layers, w: min(v, 2),
    "n_group": lambda v, layers, w: 1,
    "topk_group": lambda v, layers, w: 1,
    "n_shared_experts": lambda v, layers, w: min(v, 1),
    "first_k_dense_replace": lambda v, layers, w: min(v, 1),
    "kv_lora_rank": lambda v, layers, w: w // 2,
    "q_lora_rank": lambda v, layers, w: w // 2,
    "qk_rope_head_dim": lambda v, layers, w: 8,
    "qk_nope_head_dim": lambda v, layers, w: 8,
    "v_head_dim": lambda v, layers, w: w // 4,
}
_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout")
_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Source:
    """The model to verify: `fields` of a config.json (shrunk already), or `function` ("MODULE:FUNCTION")."""

    name: str  # what the table calls it
    fields: dict | None = None
    function: str | None = None


def shrink(fields: dict, layers: int, width: int) -> dict:
    """`fields` of a config.json with every size small and the architecture kept (see the module doc)."""
    if width % 8:
        raise UsageError(f"--width {width} must be a multiple of 8: 4 heads of a width divisible by 2")
    out = dict(fields)
    for key, size in _SIZES.items():
        if isinstance(out.get(key), int) and not isinstance(out.get(key), bool):
            out[key] = size(out[key], layers, width)
    if "qk_rope_head_dim" in fields and fields.get("head_dim") == fields["qk_rope_head_dim"]:
        out["head_dim"] = out["qk_rope_head_dim"]  # DeepSeek's MLA: head_dim names the rotary part
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if isinstance(kv, int):
        out["num_key_value_heads"] = 4 if kv == heads else 2  # grouped-query attention stays grouped
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:layers]
    if isinstance(out.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    for key in _DROPOUTS:
        if isinstance(out.get(key), float):
            out[key] = 0.0
    for key in _TOKENS:
        if isinstance(out.get(key), int) and out[key] >= VOCAB:
            out[key] = None
    out.pop("torch_dtype", None)
    out.pop("dtype", None)
    return out


def _hf_build(fields: dict) -> nn.Module:
    from torchfleet.plan.library_model import transformers_config

    config = transformers_config(fields)  # one sentence where transformers is not installed
    import transformers

    transformers.logging.set_verbosity_error()  # its notes on the shrunk config, from every process
    return transformers.AutoModelForCausalLM.from_config(config)  # fp32: torch's default dtype


def _tokens(n: int, seed: int) -> tuple[dict, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build(source: Source) -> tuple[nn.Module, Callable[[int, int], tuple], Callable]:
    """(model, batch(n, seed) -> (inputs, targets), loss_fn): built alike in every process after one seed."""
    if source.fields is not None:
        return _hf_build(source.fields), _tokens, lm_loss
    from torchfleet.bench import user_model

    assert source.function is not None
    model, make_batch, loss_fn = user_model.build(source.function)

    def batch(n: int, seed: int) -> tuple:
        torch.manual_seed(10_000 + seed)  # the user's make_batch draws from torch's generator: a batch per seed
        return make_batch(n)

    return model, batch, loss_fn
