"""`gpt`: a decoder-only transformer, GPT-2's architecture in our own code.

Token and position embeddings, `n_layer` pre-norm blocks in an
``nn.ModuleList`` (attention, then an MLP, each added to the residual
stream), a final LayerNorm and a bias-free head to the vocabulary. It is the
shape of model the sharding, pipeline and tensor-parallel strategies exist
for, which the small digits classifiers are not.

Three choices serve the strategies:
- q, k and v are separate ``nn.Linear`` layers (GPT-2 fuses them into one
  ``c_attn``): tensor parallelism shards each by columns, so every rank holds
  whole heads; a fused projection sharded by columns would give rank 0 all of
  q and half of k instead.
- attention reshapes with the head size fixed and the head count inferred
  (``view(B, T, -1, head_dim)``), so the same code runs on a rank that holds
  ``n_head / tp`` heads.
- dropout defaults to 0: with it, every strategy computes the same function
  as serial, which the equivalence tests compare weight for weight.

``tie_embeddings=True`` makes the head and the token embedding one parameter,
as GPT-2 does (its 124M count includes the embedding once).

``vocab_multiple=64`` pads the embedding and the head to a multiple of 64 rows
(the ``gpt2`` preset's 50,257 to 50,304, as nanoGPT does): a GPU's matrix
kernels run on aligned widths, and GPT-2's odd vocabulary put its output layer
on slow unaligned ones (docs/benchmarks). The head returns only the first
``vocab_size`` columns, so a padded row is never a prediction: it is not
sampled, takes no share of the softmax and gets no gradient.

``experts=E`` makes every block's MLP a mixture of E SiLU-gated experts, each
as wide as the dense MLP, of which each token uses ``top_k`` (models/moe.py,
Mixtral's layout): the built-in ``gpt-moe`` is a preset's GPT with 8 experts,
top-2. Attention stays dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from torchfleet.errors import UsageError, choice_error
from torchfleet.models.moe import MoEFeedForward


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes: the built-in text corpus is byte-level
    block_size: int = 64  # the longest sequence, and the position table's length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = False
    experts: int = 0  # 0: dense MLPs; E: each block's MLP a mixture of E experts
    top_k: int = 2  # experts per token, with experts
    moe_aux_loss: bool = False  # each MoE block keeps its load-balancing loss (moe.aux_loss sums them)
    vocab_multiple: int = 1  # the embedding's and head's rows, padded up to a multiple of this

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "vocab_multiple"):
            if getattr(self, name) < 1:
                raise UsageError(f"GPTConfig {name}={getattr(self, name)} must be at least 1")
        if self.n_embd % self.n_head:
            raise UsageError(
                f"GPTConfig n_embd={self.n_embd} does not split into n_head={self.n_head} heads;"
                " choose n_embd a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"GPTConfig dropout={self.dropout} must be in [0, 1)")
        if self.experts < 0:
            raise UsageError(f"GPTConfig experts={self.experts} must be 0 (dense MLPs) or at least 1")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise UsageError(
                f"GPTConfig top_k={self.top_k} must be between 1 and experts={self.experts}:"
                " each token goes to top_k of the experts"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab(self) -> int:
        """The embedding's and head's rows: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def base_model_pp_plan(self) -> dict[str, tuple[list[str], list[str]]]:
        """The pipeline plan, in transformers' form: {module: (inputs, outputs)} in forward order.

        torchfleet's pipelines cut a model with a plan between its blocks and run its own forward
        on each stage (strategies/pipeline/declared_cut.py) instead of tracing it: a traced stage's forward
        was about 20% slower on gpt tiny (docs/benchmarks/history.md)."""
        return {
            "tok_emb": (["idx"], ["tokens"]),
            "pos_emb": (["idx"], ["positions"]),
            "drop": (["tokens", "positions"], ["hidden"]),
            "blocks": (["hidden"], ["hidden"]),
            "norm": (["hidden"], ["hidden"]),
            "head": (["hidden"], ["logits"]),
        }


# Parameter counts are in tests/models/test_models.py; `tiny` trains in seconds on 2 CPU cores.
PRESETS = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64),  # 236,928
    "small50m": GPTConfig(vocab_size=256, block_size=256, n_layer=8, n_head=12, n_embd=768),  # 57,294,336
    # GPT-2 small: its 124,439,808 parameters and 47 padded rows of 768 (36,096) for aligned kernels.
    "gpt2": GPTConfig(
        vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, tie_embeddings=True, vocab_multiple=64
    ),  # 124,475,904
}


MOE_EXPERTS, MOE_TOP_K = 8, 2  # `gpt-moe`: Mixtral's 8 experts, top-2


def gpt_config(preset: str, experts: int = 0, top_k: int = MOE_TOP_K) -> GPTConfig:
    """The preset's config, with `experts` (0: dense) each using `top_k` of them per token."""
    if preset not in PRESETS:
        raise choice_error("gpt preset", preset, tuple(PRESETS))
    return replace(PRESETS[preset], experts=experts, top_k=top_k) if experts else PRESETS[preset]


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (see the module doc)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: under tensor parallelism this rank's q, k and v hold n_head / tp of them.
        q, k, v = (p(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class VocabHead(nn.Linear):
    """The output layer over a padded vocabulary: `padded` rows, of which forward returns the first
    `vocab_size` (see the module doc). Only a padded GPT has one; otherwise the head is a plain Linear."""

    def __init__(self, n_embd: int, vocab_size: int, padded: int):
        super().__init__(n_embd, padded, bias=False)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., : self.vocab_size]


class Block(nn.Module):
    """Pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)); mlp a mixture of experts with cfg.experts."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = (
            MoEFeedForward(cfg.n_embd, 4 * cfg.n_embd, cfg.experts, cfg.top_k, keep_aux_loss=cfg.moe_aux_loss)
            if cfg.experts
            else MLP(cfg)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx: LongTensor (B, T)) -> logits (B, T, vocab_size); T <= block_size.

    Its config declares a pipeline plan (GPTConfig.base_model_pp_plan), as transformers' models do."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = (
            nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            if cfg.padded_vocab == cfg.vocab_size
            else VocabHead(cfg.n_embd, cfg.vocab_size, cfg.padded_vocab)
        )
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: each residual projection scaled by 1/sqrt(2 n_layer), since 2 n_layer of them add
        # into the residual stream and its variance would otherwise grow with depth.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight", "mlp.experts.down_proj")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden`, in place of `idx`: the activation entering the first block (B, T, n_embd), as a
        pipeline's later stages receive it; their embeddings are not theirs to run."""
        if hidden is None:
            assert idx is not None, "GPT.forward takes idx or hidden"
            length = idx.shape[1]
            if length > self.config.block_size:
                raise UsageError(
                    f"a sequence of {length} tokens is longer than this GPT's block_size"
                    f" {self.config.block_size}; cut the input or choose a larger block_size"
                )
            positions = torch.arange(length, device=idx.device)
            hidden = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))

    def tp_plan(self, tp: int = 1) -> dict:
        """Tensor-parallel styles by module name (relative to this model), Megatron's split:
        q, k, v and the MLP's fc by columns (each rank whole heads, a slice of the hidden
        units), the two output projections by rows, so each block needs one all-reduce per
        sublayer. Embeddings, norms and the head stay replicated, and so does a mixture of
        experts (router and experts whole on every rank, each computing the same tokens): expert
        parallelism is what splits experts. `tp`, the degree, must divide the heads: attention
        runs on whole heads."""
        # Imported here: torch.distributed.tensor is slow to import and only TP needs it.
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        heads = self.config.n_head
        if heads % tp:
            raise UsageError(
                f"tensor parallelism over {tp} processes would split this GPT's {heads} attention"
                f" heads unevenly (each rank needs whole heads); choose a --tp that divides {heads}"
            )

        dense = not self.config.experts
        plan = {}
        for i in range(len(self.blocks)):
            for name in ("attn.q", "attn.k", "attn.v", *(("mlp.fc",) if dense else ())):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.proj", *(("mlp.proj",) if dense else ())):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        return plan


def gpt(preset: str = "tiny") -> GPT:
    return GPT(gpt_config(preset))


def gpt_moe(preset: str = "tiny", experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K) -> GPT:
    """`gpt-moe`: the preset's GPT with every block's MLP a mixture of `experts`, `top_k` per token."""
    return GPT(gpt_config(preset, experts, top_k))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
