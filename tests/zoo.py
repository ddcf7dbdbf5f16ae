"""Models other people wrote, built from configs at their libraries' defaults (no download).

Only the sizes are set small and dropout off (every strategy must compute
serial's function, and dropout draws differ between process layouts); every
other setting is the library's own: GPT-2's ``use_cache``, Llama's tied or
untied head, BERT's non-persistent buffers and tied decoder bias. Besides
the transformers models: a model whose forward returns a dict, one whose
forward reads buffers, and nanoGPT's calling convention
(``model(idx, targets)`` returning ``(logits, loss)``).

Each entry gives a model, a batch maker (inputs as ``train_step`` gets them,
and targets) and a loss function over what the model returns in serial.
Workers started by `torchfleet.launch` import this module by name (spawn
hands them the parent's ``sys.path``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, CLASSES = 64, 16, 10
# The router loss's weight in the aux entries. At the configs' default (0.001) each rank's own loss,
# averaged, moved the weights only 1.2e-7 from serial's in 5 steps, below the zoo's 1e-5; at 1 by 8.6e-5.
ROUTER_AUX_COEF = 1.0


def _lm_loss(output, targets):
    logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _tokens(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=4,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def hf_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=SEQ,
            tie_word_embeddings=tie,
        )
    )


def hf_mixtral(**config):
    """Mixtral with 4 experts, 2 per token; transformers 5 fuses each layer's experts into 3-D parameters."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,  # its default (8 of 32 heads) scaled down: grouped-query attention kept
            max_position_embeddings=SEQ,
            num_local_experts=4,
            num_experts_per_tok=2,
            **config,
        )
    )


IDLE_EXPERT = 3


def hf_mixtral_idle_expert():
    """hf_mixtral in which no token reaches expert IDLE_EXPERT, in any layer, at any step.

    A linear router cannot rule an expert out for every hidden state (the opposite state turns
    its logits round), so the hidden states are given a sign: every token's embedding is 0.1 on
    its first feature (5 times the others' spread), which the residual stream keeps positive
    through every layer, and that expert's router row reads only that feature, at -50. Its logit
    is then about -100 while the others' stay within 0.3 of 0, so it is never among the top 2;
    the other three experts share the tokens.
    """
    net = hf_mixtral()
    with torch.no_grad():
        net.model.embed_tokens.weight[:, 0] = 0.1
        for layer in net.model.layers:
            layer.mlp.gate.weight[IDLE_EXPERT] = 0.0
            layer.mlp.gate.weight[IDLE_EXPERT, 0] = -50.0
    return net


def hf_qwen2_moe(**config):
    """Qwen2-MoE with 4 routed experts, 2 per token, and its shared expert behind a sigmoid gate in every layer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQ,
            num_experts=4,
            num_experts_per_tok=2,
            **config,
        )
    )


def hf_qwen2():
    """Qwen2 at its defaults but the sizes: biases on q, k and v, and two key-value heads for four query heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
    )


# Families beyond Llama whose forwards differ around their layers (Gemma 2 soft-caps its logits, Cohere scales
# them, GPT-NeoX fuses q, k and v per head and passes hidden_states by keyword in its pipeline plan) or whose tp
# plans use styles besides colwise and rowwise (Qwen3's and Gemma 3's per-head norms, Phi-3's fused projections
# gathered, OLMo 2's gathered attention, GPT-NeoX's split embedding, Qwen3-MoE's packed experts). Only the sizes
# are small: 4 query heads and 2 key-value heads where the family has grouped-query attention, so tp 2 splits both.
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, max_position_embeddings=SEQ)


def _causal(config: str, model: str, **fields):
    import transformers

    cfg = getattr(transformers, config)(**{**SMALL, "num_attention_heads": 4, **fields})
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the full vocabulary's, outside the small one
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) >= VOCAB:
            setattr(cfg, name, None)
    return getattr(transformers, model)(cfg)


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "hf-gemma2": lambda: _causal("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=8),
    "hf-cohere": lambda: _causal("CohereConfig", "CohereForCausalLM", num_key_value_heads=2),
    "hf-gpt-neox": lambda: _causal("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "hf-qwen3": lambda: _causal("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8),
    "hf-gemma3": lambda: _causal("Gemma3TextConfig", "Gemma3ForCausalLM", num_key_value_heads=2, head_dim=8),
    "hf-phi3": lambda: _causal("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2),
    "hf-olmo2": lambda: _causal("Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2),
    "hf-qwen3-moe": lambda: _causal(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        num_key_value_heads=2,
        head_dim=8,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    ),
}


# LoRA on every attention and MLP projection (Llama's and Qwen2's names), at peft's defaults (r 8, no dropout).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`build`'s model wrapped by peft's LoRA on LORA_TARGETS (peft freezes every other parameter)."""

    def make():
        from peft import LoraConfig, get_peft_model

        return get_peft_model(build(), LoraConfig(target_modules=LORA_TARGETS))

    return make


def peft_llama():
    """hf_llama with LoRA adapters on every attention and MLP projection, at peft's defaults."""
    return with_lora(lambda: hf_llama(False))()


def hf_bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=CLASSES,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class AdapterBlock(_Block):
    """A block with a small trainable adapter beside its (frozen) layers, as adapter fine-tuning adds."""

    def __init__(self, width: int):
        super().__init__(width)
        self.adapter = nn.Linear(width, 4)
        self.up = nn.Linear(4, width)

    def forward(self, x):
        return super().forward(x) + self.up(torch.relu(self.adapter(x)))


class DictOut(nn.Module):
    """A classifier that returns ``{"logits": ..., "features": ...}``, as many research models do."""

    def __init__(self, width: int = 32, depth: int = 4, block=_Block):
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        h = self.embed(x.flatten(1))
        for block in self.blocks:
            h = block(h)
        return {"logits": self.head(h), "features": h}


class WithBuffers(nn.Module):
    """A model whose forward reads its buffers: a persistent input normaliser and a non-persistent table."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.register_buffer("mean", torch.linspace(-0.5, 0.5, 64))
        self.register_buffer("scale", torch.full((64,), 2.0))
        self.register_buffer("phase", torch.arange(width, dtype=torch.float32) / width, persistent=False)
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        h = self.embed((x.flatten(1) - self.mean) * self.scale)
        for i, block in enumerate(self.blocks):
            h = block(h + self.phase * (i + 1))
        return self.head(h)


class NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.register_buffer("mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1), persistent=False)

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[: x.size(1), : x.size(1)], need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's interface: ``model(idx, targets=None) -> (logits, loss)``, tied embeddings, ``transformer.h``."""

    def __init__(self, width: int = 32, depth: int = 4, heads: int = 4):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, width),
                wpe=nn.Embedding(SEQ, width),
                h=nn.ModuleList(NanoBlock(width, heads) for _ in range(depth)),
                ln_f=nn.LayerNorm(width),
            )
        )
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(depth))

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def frozen(build: Callable[[], nn.Module], trains: Callable[[str], bool]) -> Callable[[], nn.Module]:
    """`build`, with every parameter whose name `trains` refuses frozen (requires_grad False)."""

    def make():
        net = build()
        for name, p in net.named_parameters(remove_duplicate=False):
            p.requires_grad_(trains(name))
        return net

    return make


@dataclass(frozen=True)
class Entry:
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple]  # (batch size, seed) -> (inputs, targets)
    loss: Callable


def _ids(batch, seed):
    x, y = _tokens(batch, seed)
    return {"input_ids": x}, y


def _masked(batch, seed):
    x, y = _tokens(batch, seed)
    mask = torch.ones_like(x)
    mask[:, -3:] = 0  # padding at the end of every sequence: the mask changes the result
    return {"input_ids": x, "attention_mask": mask}, y


def _ragged(batch, seed):
    x, y = _tokens(batch, seed)
    mask = torch.ones_like(x)
    for row in range(batch):  # row i ends in i padding tokens: the ranks' shares hold different numbers of tokens
        mask[row, SEQ - row % SEQ :] = 0
    return {"input_ids": x, "attention_mask": mask}, y


def _ids_labels(batch, seed):
    x, _ = _tokens(batch, seed)
    return {"input_ids": x, "labels": x}, x  # the model shifts the labels and computes its own loss


def _images(batch, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def _digits(batch, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def _idx_targets(batch, seed):
    x, y = _tokens(batch, seed)
    return {"idx": x, "targets": y}, y


def _nano_loss(output, _targets):
    return output[1]  # the model computed it, as nanoGPT's train.py uses it


def _nano_logits_loss(output, targets):
    logits, none = output  # serial gives (logits, None) without targets
    assert none is None, "the loss function must receive what the model returns"
    return _lm_loss(logits, targets)


def _lm_and_router_loss(output, targets):
    """The logits' loss plus the router's load-balancing loss (the model's aux_loss), as a script may add them."""
    return _lm_loss(output, targets) + ROUTER_AUX_COEF * output.aux_loss


def _positional_ids(batch, seed):
    return _tokens(batch, seed)


ZOO: dict[str, Entry] = {
    "hf-gpt2": Entry(hf_gpt2, _ids, _lm_loss),
    "hf-llama": Entry(lambda: hf_llama(False), _ids, _lm_loss),
    "hf-llama-tied": Entry(lambda: hf_llama(True), _ids, _lm_loss),
    "hf-llama-labels": Entry(lambda: hf_llama(False), _ids_labels, lambda out, _targets: out.loss),
    "hf-mixtral": Entry(hf_mixtral, _ids, _lm_loss),
    "hf-qwen2-moe": Entry(hf_qwen2_moe, _ids, _lm_loss),
    # The router's load-balancing loss turned on: in the model's own loss (with labels), or added to the logits' loss.
    "hf-mixtral-aux": Entry(
        lambda: hf_mixtral(output_router_logits=True, router_aux_loss_coef=ROUTER_AUX_COEF),
        _ids_labels,
        lambda out, _targets: out.loss,
    ),
    "hf-qwen2-moe-aux": Entry(lambda: hf_qwen2_moe(output_router_logits=True), _ragged, _lm_and_router_loss),
    "hf-mixtral-idle-expert": Entry(hf_mixtral_idle_expert, _ids, _lm_loss),
    "hf-bert": Entry(hf_bert, _masked, _lm_loss),
    "hf-vit": Entry(
        hf_vit,
        lambda b, s: ({"pixel_values": _images(b, s)[0]}, _images(b, s)[1]),
        lambda out, y: F.cross_entropy(out.logits, y),
    ),
    **{name: Entry(build, _ids, _lm_loss) for name, build in FAMILIES.items()},
    "dict-out": Entry(DictOut, _digits, lambda out, y: F.cross_entropy(out["logits"], y)),
    "buffers": Entry(WithBuffers, _digits, F.cross_entropy),
    "nanogpt": Entry(NanoGPT, _idx_targets, _nano_loss),
    "nanogpt-idx": Entry(NanoGPT, _positional_ids, _nano_logits_loss),
    # Fine-tuning set-ups: a frozen tied embedding (GPT-2's wte is its head), a frozen untied
    # one, and adapters (every block's own layers frozen, a small trainable layer in each).
    "frozen-tied": Entry(frozen(hf_gpt2, lambda n: "wte" not in n and "lm_head" not in n), _ids, _lm_loss),
    "frozen-embed": Entry(frozen(lambda: hf_llama(False), lambda n: "embed_tokens" not in n), _ids, _lm_loss),
    "adapters": Entry(
        frozen(lambda: DictOut(block=AdapterBlock), lambda n: "adapter" in n or ".up." in n),
        _digits,
        lambda out, y: F.cross_entropy(out["logits"], y),
    ),
}


def train_zoo(strategy: str, name: str, **options) -> dict | None:
    """Zoo model `name` trained under `strategy` by `torchfleet verify`'s own case (verify/train.py's train_case:
    5 SGD steps of batch 8 by default; `save_to`, `adapters_to`, `memory` as it takes them): {"weights": ...,
    "notes": ..., "memory": ...} on the main rank, {"refused": the sentence} where setup refuses, None elsewhere."""
    from torchfleet.verify.train import train_case

    entry = ZOO[name]
    return train_case(strategy, entry.build, entry.batch, entry.loss, **options)


def checkpoint_job(strategy: str, name: str, directory: str) -> dict | None:
    """Save a sharded checkpoint after 2 steps, train 2 more, load it back.

    On the main rank: the weights at the save, after loading, and the model keys the checkpoint holds.
    """
    from torchfleet import Fleet
    from torchfleet.checkpoint.sharded import SafeReader

    entry = ZOO[name]
    fleet = Fleet(strategy=strategy)
    torch.manual_seed(0)
    net = entry.build()
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2), example_inputs=_rows(entry.batch(8, 0), 0, 1)[0])
    for seed in range(4):
        if seed == 2:
            fleet.save(f"{directory}/step-2", sharded=True)
            saved, _ = fleet.strategy.state_dicts()
        fleet.train_step(*_rows(entry.batch(8, seed), 0, 1), entry.loss)
    fleet.load(f"{directory}/step-2")
    loaded, _ = fleet.strategy.state_dicts()
    held = SafeReader(f"{directory}/step-2/model").read_metadata().state_dict_metadata
    fleet.close()
    if not fleet.is_main:
        return None
    return {
        "saved": saved,
        "loaded": loaded,
        "keys": sorted(k[len("model.") :] for k in held if k.startswith("model.")),
    }


def _rows(batch, rank: int, world: int):
    """This data rank's rows of a global batch, as fleet.dataloader would give them."""
    from torchfleet.verify.train import rows

    return rows(batch, rank, world)


def zoo_matrix(jobs: list[tuple[str, str, dict]]) -> list:
    """`train_zoo` for each (strategy, model, options) in one set of processes."""
    results = [train_zoo(strategy, name, **options) for strategy, name, options in jobs]
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return results


# The models the peft entries adapt: built after torch.manual_seed(0), as train_zoo builds its models, their
# weights are the adapted model's (peft draws its adapters after the model is built).
PEFT_BASES: dict[str, Callable[[], nn.Module]] = {"peft-llama": lambda: hf_llama(False), "peft-qwen2": hf_qwen2}
if importlib.util.find_spec("peft") is not None:  # the dev extra installs it; without it the rest still runs
    ZOO["peft-llama"] = Entry(peft_llama, _ids, _lm_loss)
    ZOO["peft-qwen2"] = Entry(with_lora(hf_qwen2), _ids, _lm_loss)


def _adapted(kind: str) -> Callable[[], nn.Module]:
    """hf_llama with one of peft's other adapters on its attention and MLP projections, at peft's defaults."""

    def make():
        import peft

        targets = ["q_proj", "v_proj", "down_proj"]
        config = {
            "dora": lambda: peft.LoraConfig(target_modules=targets, use_dora=True),
            "ia3": lambda: peft.IA3Config(target_modules=targets, feedforward_modules=["down_proj"]),
            "loha": lambda: peft.LoHaConfig(target_modules=targets),
        }[kind]()
        return peft.get_peft_model(hf_llama(False), config)

    return make


# Adapters tp does not split (their tensors span a layer's whole width): refused in one sentence there.
ADAPTERS_TP_REFUSES = {"peft-llama-dora": "DoRA", "peft-llama-ia3": "IA3", "peft-llama-loha": "LoHa"}
if importlib.util.find_spec("peft") is not None:
    for _name, _kind in ADAPTERS_TP_REFUSES.items():
        ZOO[_name] = Entry(_adapted(_kind.lower()), _ids, _lm_loss)


def fsdp_traffic_job(names: list[str], steps: int = 2) -> dict | None:
    """`fsdp_traffic` for each zoo model of `names` in one set of processes: {name: its report} on the main rank."""
    found = {name: fsdp_traffic(name, steps) for name in names}
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return found if found[names[0]] is not None else None


def fsdp_traffic(name: str, steps: int) -> dict | None:
    """Zoo model `name` under fsdp for `steps` AdamW steps, its optimizer given every parameter (frozen ones too).

    The main rank reports what each step reduce-scattered (the bytes of the collectives' inputs, every
    one counted as it runs: the real collective still runs), which parameters held a gradient after the
    last step, which ones the optimizer keeps state for, and which ones train; None on the other ranks.
    """
    from torchfleet import Fleet

    entry = ZOO[name]
    fleet = Fleet(strategy="fsdp")
    torch.manual_seed(0)
    net = entry.build()
    fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2), example_inputs=_rows(entry.batch(8, 0), 0, 2)[0])
    model, optimizer = fleet.strategy.model, fleet.strategy.optimizer
    sent: list[int] = []
    with _counting_reduce_scatters(sent):
        per_step = []
        for seed in range(steps):
            before = sum(sent)
            fleet.train_step(*_rows(entry.batch(8, seed), *fleet.strategy.data_coords()), entry.loss)
            per_step.append(sum(sent) - before)
    names = {id(p): n for n, p in model.named_parameters()}
    found = {
        "reduce_scattered": per_step,
        "with_grad": sorted(n for n, p in model.named_parameters() if p.grad is not None),
        "with_state": sorted(names[id(p)] for p, state in optimizer.state.items() if state),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "world": fleet.world_size,
    }
    return found if fleet.is_main else None


@contextlib.contextmanager
def _counting_reduce_scatters(sent: list[int]):
    """Each reduce-scatter's input bytes appended to `sent`; FSDP2 calls torch.distributed's function by
    name at each call (reduce_scatter_single from torch 2.14, reduce_scatter_tensor before)."""
    dist = torch.distributed
    originals = {n: getattr(dist, n) for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)}

    def counted(original, input_at: int):
        def call(*args, **kwargs):
            tensor = kwargs["input"] if "input" in kwargs else args[input_at]
            sent.append(tensor.numel() * tensor.element_size())
            return original(*args, **kwargs)

        return call

    try:
        for n, original in originals.items():
            setattr(dist, n, counted(original, 1))  # (output, input, ...) in both
        yield
    finally:
        for n, original in originals.items():
            setattr(dist, n, original)
