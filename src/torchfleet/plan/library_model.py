"""A library model for planning at scale: a Hugging Face config.json, built only on fake tensors.

`plan --hf-config` takes a shipped name (the files in hf_configs/, public
architecture figures of well-known models) or a path to any config.json.
Nothing is downloaded and no weight is allocated: the model is built under
torch's FakeTensorMode, so Llama 3.1 405B costs this machine what its
module objects cost, not 1.6 TB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchfleet.errors import UsageError

CONFIGS = Path(__file__).with_name("hf_configs")


def shipped() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in CONFIGS.glob("*.json")))


def read_config(name_or_path: str) -> dict:
    """The config's fields, from a shipped name or a file; one sentence (UsageError) for anything else."""
    path = CONFIGS / f"{name_or_path}.json"
    if not path.is_file():
        path = Path(name_or_path)
    if not path.is_file():
        raise UsageError(
            f"--hf-config {name_or_path!r} is neither a file nor a shipped config; give a"
            f" config.json's path or one of {', '.join(shipped())}"
        )
    try:
        fields = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--hf-config {path} is not a model config: it cannot be read as JSON ({exc})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise UsageError(
            f"--hf-config {path} is not a model config: a Hugging Face config.json names its"
            " model_type, and this file has none"
        )
    return checked(fields, f"--hf-config {path}")


# Older configs' names for the fields plan reads (T5's, GPT-2's), as transformers' attribute_map aliases them.
ALIASES = {
    "hidden_size": ("d_model", "n_embd"),
    "num_attention_heads": ("num_heads", "n_head"),
    "num_hidden_layers": ("num_layers", "n_layer"),
}


def checked(fields: dict, what: str) -> dict:
    fields = dict(fields)
    for key, others in ALIASES.items():
        found = [fields[o] for o in others if o in fields]
        if key not in fields and found:
            fields[key] = found[0]
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if not isinstance(fields.get(key), int) or fields[key] < 1:
            raise UsageError(
                f"{what} is not a transformer model config that plan can trace: it has no positive integer {key}"
            )
    return fields


def default_seq(fields: dict) -> int:
    """Tokens a sample when --seq-len is not given: torchtitan's 8192, or the model's own longest sequence where
    shorter (BERT's 512 learned positions, which a longer sequence would index past; T5's 512 of pre-training)."""
    limit = fields.get("max_position_embeddings") or fields.get("n_positions")
    return min(8192, limit) if isinstance(limit, int) and limit > 0 else 8192


def fields_of(model) -> dict | None:
    """The config fields of a transformers model (a `plan --model` builder's, built on meta), peft's wrapping
    looked through; None for any other model."""
    from torchfleet.strategies.blocks import library_model

    config: Any = getattr(library_model(model), "config", None)  # a transformers PretrainedConfig
    if not callable(getattr(config, "to_dict", None)) or not getattr(config, "model_type", None):
        return None
    return config.to_dict()


def transformers_config(fields: dict, layers: int | None = None):
    """transformers' config object for `fields`, with `layers` decoder blocks where given."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise UsageError(
            "--hf-config needs transformers to build the model's modules (nothing is downloaded), which is not"
            " installed here: pip install 'torchfleet[hf]'"
        ) from None
    fields = dict(fields)
    if layers is not None:  # an encoder-decoder's decoder keeps its share of the blocks
        encoder = fields["num_hidden_layers"]
        if fields.get("num_decoder_layers"):
            fields["num_decoder_layers"] = max(1, round(layers * fields["num_decoder_layers"] / encoder))
        for key in ("num_hidden_layers", *ALIASES["num_hidden_layers"]):
            if key in fields:
                fields[key] = layers
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as exc:
        raise UsageError(
            f"--hf-config's model_type {model_type!r} is not one this transformers knows"
            f" ({str(exc).splitlines()[0][:120]})"
        ) from None


def kind(fields: dict) -> str:
    """ "encoder-decoder" (T5), "encoder" (BERT: a masked language model) or "decoder" (a causal one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if transformers_config(fields, 1).is_encoder_decoder:
        return "encoder-decoder"
    return "encoder" if fields["model_type"] in MODEL_FOR_MASKED_LM_MAPPING_NAMES else "decoder"


def build(fields: dict, layers: int | None = None):
    """The model with fp32 parameters (the master weights) and its language-model head: causal for a decoder,
    sequence-to-sequence for an encoder-decoder, masked for an encoder; call it under FakeTensorMode."""
    import torch

    config = transformers_config(fields, layers)  # refuses first, in one sentence, where transformers is missing
    import transformers

    auto = {
        "decoder": "AutoModelForCausalLM",
        "encoder-decoder": "AutoModelForSeq2SeqLM",
        "encoder": "AutoModelForMaskedLM",
    }
    head = auto[kind(fields)]
    try:
        model = getattr(transformers, head).from_config(config, dtype=torch.float32)
    except ValueError as exc:
        raise UsageError(
            f"--hf-config's {type(config).__name__} has no {head[len('AutoModelFor') :]} model in transformers,"
            f" so plan cannot train it ({str(exc).splitlines()[0][:120]})"
        ) from None
    block_lists(model)  # a model without a list of blocks is refused here, before any tracing
    return model


STAGES = ("whole", "first", "middle", "last")


def keep_stage(model, stage: str) -> None:
    """Keep what a pipeline stage of `model` holds, as torchtitan cuts a decoder: the token embedding on the
    first stage only, the final norm and the output layer on the last only. A stage without the embedding
    takes hidden states (inputs_embeds); one without the output layer returns them."""
    from torch import nn

    inner = model.get_submodule(model.base_model_prefix)
    if stage in ("middle", "last"):
        inner.embed_tokens = None
    if stage in ("first", "middle"):
        inner.norm = nn.Identity()
        model.lm_head = nn.Identity()


def block_lists(model) -> list:
    """The model's lists of blocks (FSDP's units, checkpointing's units): a decoder's one, an encoder's (BERT's
    encoder.layer), or an encoder-decoder's two (T5's encoder.block and decoder.block); or one sentence."""
    from torch import nn

    inner = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    places = [(inner, "layers"), (getattr(inner, "encoder", None), "layer")]
    places += [(getattr(model, part, None), "block") for part in ("encoder", "decoder")]
    found = [getattr(o, name) for o, name in places if isinstance(getattr(o, name, None), nn.ModuleList)]
    if not found or not all(len(f) for f in found):
        raise UsageError(
            f"{type(model).__name__} keeps no list of blocks at .{model.base_model_prefix}.layers (nor an"
            " encoder's and decoder's), so plan cannot shard or checkpoint it block by block"
        )
    return found


def blocks(model):
    """The model's first list of blocks: a decoder's (what tensor and expert parallelism split)."""
    return block_lists(model)[0]


def parameter_count(fields: dict) -> int:
    """Parameters of the whole model, every block built on the meta device (no storage: DeepSeek-V3's 671 B in 5 s).

    Counted, not carried from one block to the rest: DeepSeek-V3's first three blocks are dense and the other
    58 hold 256 experts each, which a count carried from the first block put at 37.4 B."""
    import torch

    with torch.device("meta"):
        model = build(fields)
    return sum(p.numel() for p in model.parameters())
