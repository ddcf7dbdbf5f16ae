"""What torch.compile changes in the tensors a traced step holds (`plan --compile`).

Inductor fuses a chain of pointwise operators, with the reductions between them, into one kernel, and its
partitioner saves for backward the chain's inputs and small statistics, recomputing the rest inside the
backward's kernel. Eager holds every link of the chain: RMSNorm's fp32 copy, its squares and its normalised
output; SwiGLU's activated gate beside the gate and the up projection; cross-entropy's fp32 logits and their
log-softmax, and in backward three fp32 tensors the size of the logits at once.

`use(model, components)` routes a transformers model's links through one operator each, as a fused kernel
holds them, for the components torchtitan compiles (`compile.components`):

- "model" (each block compiled): every RMSNorm (`torchfleet::rms_norm`: saves its input and one fp32
  reciprocal a row; Gemma's 1 + weight included) and every gated MLP's activation times its up projection
  (`torchfleet::glu`: saves the gate and the up projection);
- "loss" (the loss compiled; torchtitan compiles it with the blocks from April 2025, bbb1b616e, and not
  before): `cross_entropy` (saves the logits in their own dtype and one fp32 log-sum-exp a row; backward
  writes the logits' gradient in their dtype at once).

Under tensor parallelism a compiled step is held as eager's: DTensor has no sharding rule for these
operators (the sequence-parallel norms, the loss on the vocabulary's shards), so the plan holds every link
there, a few percent more than a compiled run.

Their real kernels compute the same thing plainly, for tests on real tensors; their temporaries stay inside
the operator, as a fused kernel's stay on chip. The step's time is priced from the eager operators under
plan/kernels.py's rule for compile (each pointwise operator writes its output, reads nothing), so these
change what a step holds, not what it costs.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("torchfleet::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normalised x times weight + offset, in x's dtype; one fp32 reciprocal RMS a row)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = (x32 * rstd).to(x.dtype) * (weight + offset).to(x.dtype)
    return out.contiguous(), rstd.contiguous()


@rms_norm.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("torchfleet::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight): y = n w', n = x r, so dn = dy w', dx = r (dn - n mean(dn n)), dw = sum(dy n)."""
    n = x.float() * rstd
    dn = grad.float() * (weight.float() + offset)
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    dw = (grad.float() * n).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad, x, weight, rstd, offset):
    return torch.empty_like(x), torch.empty_like(weight)


def _norm_keep(ctx, inputs, output) -> None:
    x, weight, _eps, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _norm_backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(grad, x, weight, rstd, ctx.offset)
    return dx, dw, None, None


rms_norm.register_autograd(_norm_backward, setup_context=_norm_keep)


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@torch.library.custom_op("torchfleet::glu", mutates_args=())
def glu(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up."""
    return (_activation(act)(gate) * up).contiguous()


@glu.register_fake
def _(gate, up, act):
    return torch.empty_like(up)


# The activations a gated MLP's fused kernel is planned for, each with its derivative's operator (a custom
# operator's kernel runs below autograd); a model with another keeps its eager MLP.
_DERIVATIVES = {
    "silu": lambda g, x: torch.ops.aten.silu_backward(g, x),
    "swish": lambda g, x: torch.ops.aten.silu_backward(g, x),
    "gelu": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="none"),
    "gelu_pytorch_tanh": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "gelu_new": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "relu": lambda g, x: torch.ops.aten.threshold_backward(g, x, 0),
}


@torch.library.custom_op("torchfleet::glu_backward", mutates_args=())
def glu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of act(gate) * up."""
    dgate = _DERIVATIVES[act](grad * up, gate)
    return dgate.contiguous(), (grad * _activation(act)(gate)).contiguous()


@glu_backward.register_fake
def _(grad, gate, up, act):
    return torch.empty_like(gate), torch.empty_like(up)


def _glu_keep(ctx, inputs, output) -> None:
    gate, up, act = inputs
    ctx.save_for_backward(gate, up)
    ctx.act = act


def _glu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    dgate, dup = glu_backward(grad, gate, up, ctx.act)
    return dgate, dup, None


glu.register_autograd(_glu_backward, setup_context=_glu_keep)


@torch.library.custom_op("torchfleet::cross_entropy", mutates_args=())
def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean cross-entropy of fp32 logits, fp32; the log-sum-exp a row) for logits [N, V], targets [N]."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    picked = logits.float().gather(1, targets[:, None]).squeeze(1)
    return (lse - picked).mean(), lse


@_cross_entropy.register_fake
def _(logits, targets):
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(logits.shape[:1], dtype=torch.float32)


@torch.library.custom_op("torchfleet::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(
    grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """d loss / d logits in the logits' dtype: (softmax - one hot) x grad / N."""
    probs = (logits.float() - lse[:, None]).exp()
    probs.scatter_add_(1, targets[:, None], -torch.ones_like(probs[:, :1]))
    return (probs * (grad / logits.shape[0])).to(logits.dtype)


@_cross_entropy_backward.register_fake
def _(grad, logits, targets, lse):
    return torch.empty_like(logits)


def _loss_keep(ctx, inputs, output) -> None:
    logits, targets = inputs
    ctx.save_for_backward(logits, targets, output[1])


def _loss_backward(ctx, grad, _grad_lse):
    logits, targets, lse = ctx.saved_tensors
    return _cross_entropy_backward(grad, logits, targets, lse), None


_cross_entropy.register_autograd(_loss_backward, setup_context=_loss_keep)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss, `F.cross_entropy(logits.float(), targets)`, as a compiled loss holds it."""
    return _cross_entropy(logits, targets)[0]


def _norm_forward(module, offset: float):
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))

    def forward(hidden_states):
        return rms_norm(hidden_states, module.weight, eps, offset)[0]

    return forward


def _mlp_forward(module, act: str):
    def forward(x):
        return module.down_proj(glu(module.gate_proj(x), module.up_proj(x), act))

    return forward


def use(model, components: tuple[str, ...]) -> int:
    """Route `model`'s RMSNorms and gated MLPs through the fused operators where "model" is compiled; how
    many modules were routed. (The loss is the step's: `cross_entropy`.)"""
    if "model" not in components:
        return 0
    config = getattr(model, "config", None)
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    routed = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            # Gemma's norms scale by 1 + weight (its weights are stored around 0).
            module.forward = _norm_forward(module, 1.0 if name.startswith("Gemma") else 0.0)
            routed += 1
        elif all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")) and act in _DERIVATIVES:
            module.forward = _mlp_forward(module, act)
            routed += 1
    return routed
