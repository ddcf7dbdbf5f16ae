"""Attention as a GPU's fused kernels hold it, for `plan --hf-config`'s traces.

A GPU trains attention with a fused kernel (FlashAttention, cuDNN's, or memory-efficient SDPA): forward
keeps the output and one fp32 log-sum-exp a query row, backward recomputes the scores block by block, and
no batch x heads x S x S tensor is ever held. The CPU's SDPA keeps that form only where its flash kernel
applies; otherwise (value heads narrower than the query's, as DeepSeek's MLA: 192 and 128; a sliding
window or a soft cap, which transformers hands to its eager attention) it materialises the fp32 scores,
which at sequence 8192 came to 220 GiB of temporaries for DeepSeek-V2-Lite.

`use(model)` routes a transformers model's attention through `torchfleet::attention`, one operator whose
fake kernel returns what a fused kernel returns (the output, and the log-sum-exp) and whose backward
(`torchfleet::attention_backward`) returns the three gradients, for every variant: grouped key/value heads,
MLA's head widths, causal or not (encoders), a sliding window, a soft cap. Its real kernel computes the
same attention plainly (for tests on real tensors), and its temporaries stay inside the operator, as a fused
kernel's stay in its on-chip memory.
"""

from __future__ import annotations

import torch

NAME = "torchfleet_fused"  # the attention implementation's name among transformers' interfaces


def _probabilities(q, k, scale: float, causal: bool, window: int, softcap: float):
    """(softmax of the masked scores, the scores before the soft cap's tanh over the cap or None), fp32, real
    tensors; grouped key/value heads repeated to the query's."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    capped = None
    if softcap > 0:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    cols = torch.arange(k.shape[-2], device=q.device)[None, :]
    allowed = torch.ones(rows.shape[0], cols.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        allowed &= cols <= rows
    if window > 0:
        allowed &= rows - cols < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores, capped


def _plain(q, k, v, scale: float, causal: bool, window: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention on real tensors, softmax in fp32: (output, log-sum-exp)."""
    scores, _ = _probabilities(q, k, scale, causal, window, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.matmul((scores - lse[..., None]).exp(), v.float())
    return out.to(v.dtype), lse


def _plain_backward(grad, q, k, v, scale: float, causal: bool, window: int, softcap: float):
    """(dq, dk, dv) on real tensors, written out (a custom operator's kernel runs below autograd):
    dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), through the cap's tanh, dQ = scale dS K, dK = scale dS^T Q."""
    groups = q.shape[1] // k.shape[1]
    scores, capped = _probabilities(q, k, scale, causal, window, softcap)
    p = (scores - torch.logsumexp(scores, dim=-1, keepdim=True)).exp()
    kk, vv = (t.repeat_interleave(groups, dim=1).float() for t in (k, v))
    dout = grad.float()
    out = torch.matmul(p, vv)
    ds = p * (torch.matmul(dout, vv.transpose(-1, -2)) - (dout * out).sum(-1, keepdim=True))
    if capped is not None:
        ds = ds * (1 - capped**2)
    dq = scale * torch.matmul(ds, kk)
    dk = scale * torch.matmul(ds.transpose(-1, -2), q.float())
    dv = torch.matmul(p.transpose(-1, -2), dout)
    b, h, s = k.shape[:3]
    dk = dk.reshape(b, h, groups, s, -1).sum(2)
    dv = dv.reshape(b, h, groups, s, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("torchfleet::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window: int, softcap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, S, Dv], log-sum-exp [B, H, S] in fp32) of q [B, H, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]."""
    out, lse = _plain(q, k, v, scale, causal, window, softcap)
    return out.contiguous(), lse.contiguous()


@attention.register_fake
def _(q, k, v, scale, causal, window, softcap):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchfleet::attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the output's gradient; `out` and `lse` are what a fused kernel's backward reads."""
    dq, dk, dv = _plain_backward(grad, q, k, v, scale, causal, window, softcap)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward.register_fake
def _(grad, q, k, v, out, lse, scale, causal, window, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _keep(ctx, inputs, output) -> None:
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = options


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad, q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None


attention.register_autograd(_backward, setup_context=_keep)


def _transformers_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface: [B, H, S, D] in, [B, S, H, Dv] and no weights out. The trace feeds
    whole sequences without padding, so the mask is the layer's pattern: causal (or not, an encoder's), within
    its sliding window where it has one."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    window = int(kwargs.get("sliding_window") or 0)
    softcap = float(kwargs.get("softcap") or 0.0)
    out, _ = attention(query, key, value, float(scale), causal, window, softcap)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None


def use(model) -> None:
    """Route `model`'s attention (a transformers model) through `attention`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _transformers_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    model.set_attn_implementation(NAME)
