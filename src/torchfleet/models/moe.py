"""A mixture-of-experts feed-forward, in transformers 5's expert-module interface.

`MoEFeedForward` replaces a block's MLP: its router (`gate`) sends each token
to `top_k` of `num_experts` SiLU-gated MLPs (`experts`) and adds their
outputs, weighted by the router's renormalised probabilities. The names,
shapes and call signatures are Mixtral's in transformers 5 (MixtralTopKRouter,
MixtralExperts, MixtralSparseMoeBlock): ``gate.weight`` [E, H],
``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I] and
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``, so one
expert-parallel wrapper serves the built-in `gpt-moe` and a transformers MoE
model alike.

Each block keeps, when asked, the Switch Transformer's load-balancing loss
(`aux_loss`), which is off by default: training without it computes only the
language model's loss. How many tokens each expert got is counted by
strategies/expert_load.py, as for any model with experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

INIT_STD = 0.02  # GPT-2's, as the dense layers beside these get


class Experts(nn.Module):
    """`num_experts` SiLU-gated MLPs, their weights stacked: expert e computes
    ``down_proj[e] @ (silu(gate) * up)`` where ``gate, up = chunk(gate_up_proj[e] @ x, 2)``.

    forward runs only the experts that got tokens, each on its tokens: an expert with none adds
    nothing and its slice of the weights gets a zero gradient. An index of `num_experts` is
    skipped, as transformers' experts skip it: its expert parallelism marks a choice of an expert
    another process holds so."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.intermediate_dim = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act_fn = nn.SiLU()
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.down_proj, mean=0.0, std=INIT_STD)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """hidden_states [T, H], top_k_index [T, k] (long), top_k_weights [T, k] -> [T, H]."""
        out = torch.zeros_like(hidden_states)
        for expert, (slot, token) in self._routes(top_k_index):
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, (expert_out * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def _routes(self, top_k_index: torch.Tensor):
        """(expert, (slot, token)) for each expert that got tokens: the k-slots and tokens that chose it."""
        if is_fake(top_k_index):
            # On fake tensors (plan's memory trace) the choices have no values: each expert takes its balanced
            # share of the T x k choices, as the plan's expert parallelism assumes.
            tokens, k = top_k_index.shape
            share = -(-tokens * k // self.num_experts)
            place = torch.arange(share, device=top_k_index.device)
            return [(expert, (place % k, place % tokens)) for expert in range(self.num_experts)]
        with torch.no_grad():
            # [E + 1, k, T]: which (slot, token) pairs chose each expert; the last row, elsewhere.
            chosen = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = (chosen[: self.num_experts].sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
        return [(expert, torch.where(chosen[expert])) for expert in hit]


class Router(nn.Module):
    """A bias-free linear map to one logit per expert; softmax, the top k, renormalised to sum to 1.

    forward(hidden [T, H]) -> (logits [T, E], top_k_weights [T, k], top_k_index [T, k]), Mixtral's order."""

    def __init__(self, num_experts: int, hidden: int, top_k: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        # float32 softmax, as Mixtral's: in bf16 near-equal experts tie and the choice flips with rounding.
        probs = logits.float().softmax(dim=-1)
        top_weights, top_index = probs.topk(self.top_k, dim=-1)
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return logits, top_weights.to(hidden_states.dtype), top_index


def load_balancing_loss(router_logits: torch.Tensor, top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_i f_i * P_i, over one layer's T tokens.

    f_i: the share of the T * k routing choices that went to expert i; P_i: the router's mean
    probability for expert i. 1.0 when both are uniform, E when every token goes to one expert
    with certainty. Only P_i carries a gradient (the choice is discrete), which pushes the router
    towards the experts that are used less. transformers' load_balancing_loss_func counts f_i per
    token rather than per choice, so its value is k times this one."""
    probs = router_logits.float().softmax(dim=-1)
    choices = torch.zeros(num_experts, device=probs.device, dtype=probs.dtype)
    choices.scatter_add_(0, top_k_index.reshape(-1), torch.ones_like(top_k_index.reshape(-1), dtype=probs.dtype))
    return num_experts * torch.sum(choices / top_k_index.numel() * probs.mean(dim=0))


class MoEFeedForward(nn.Module):
    """A block's feed-forward as a mixture of experts: forward(x [..., H]) -> [..., H].

    After each forward with ``keep_aux_loss``: ``aux_loss``, this layer's `load_balancing_loss` with its
    gradient, for the training loss to add (`aux_loss` below sums a model's)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int = 2, keep_aux_loss: bool = False):
        super().__init__()
        self.top_k = top_k
        self.keep_aux_loss = keep_aux_loss
        self.gate = Router(num_experts, hidden, top_k)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, top_k_weights, top_k_index = self.gate(flat)
        if self.keep_aux_loss:
            self.aux_loss = load_balancing_loss(logits, top_k_index, self.experts.num_experts)
        return self.experts(flat, top_k_index, top_k_weights).reshape(x.shape)


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the load-balancing losses the model's MoE blocks kept in their last forward
    (built with ``keep_aux_loss``): ``loss = lm_loss(...) + coefficient * aux_loss(model)``.
    Under a pipeline, a stage sees only its own blocks' losses."""
    kept = [m.aux_loss for m in model.modules() if isinstance(m, MoEFeedForward) and m.aux_loss is not None]
    if not kept:
        raise ValueError("no MoE block kept a load-balancing loss: build the model with keep_aux_loss and run forward")
    return torch.stack(kept).sum()
