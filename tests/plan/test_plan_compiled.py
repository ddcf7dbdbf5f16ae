"""plan --compile's memory (plan/compiled.py): the fused operators compute what eager computes, and a traced
step holds what a fused kernel holds, not eager's links.

The operators are checked on real tensors against the eager modules transformers builds (values and every
gradient); the trace against the figures a fused kernel's saved tensors come to.
"""

from __future__ import annotations

import pytest

from helpers import require_module

require_module("transformers", "transformers (the test extra) builds the library models from configs")

import torch  # noqa: E402


def _grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*tensors)
    out.float().pow(2).sum().backward()
    return out.detach(), [t.grad for t in tensors if t.requires_grad]


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_the_fused_norm_equals_each_familys_eager_norm_and_its_gradients(family):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from torchfleet.plan import compiled

    torch.manual_seed(0)
    norm = (LlamaRMSNorm if family == "llama" else GemmaRMSNorm)(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 48)
    eager, (dx,) = _grads(norm, x)
    assert norm.weight.grad is not None
    eager_dw = norm.weight.grad.clone()
    norm.weight.grad = None
    assert compiled.use(norm, ("model",)) == 1
    fused, (fused_dx,) = _grads(lambda t: norm(t), x)
    # fp32 both ways, summed in other orders
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_dx, dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad, eager_dw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_fused_glu_equals_eager_and_its_gradients(act):
    from transformers.activations import ACT2FN

    from torchfleet.plan import compiled

    torch.manual_seed(0)
    gate, up = torch.randn(4, 7, 32, dtype=torch.float64), torch.randn(4, 7, 32, dtype=torch.float64)
    eager, eager_grads = _grads(lambda g, u: ACT2FN[act](g) * u, gate, up)
    fused, fused_grads = _grads(lambda g, u: compiled.glu(g, u, act), gate, up)
    torch.testing.assert_close(fused, eager)
    for a, b in zip(fused_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_the_fused_loss_equals_cross_entropy_on_fp32_logits_and_its_gradient():
    import torch.nn.functional as F

    from torchfleet.plan import compiled

    torch.manual_seed(0)
    logits, targets = torch.randn(12, 50, dtype=torch.bfloat16), torch.randint(0, 50, (12,))
    eager, (eager_grad,) = _grads(lambda t: F.cross_entropy(t.float(), targets), logits)
    fused, (fused_grad,) = _grads(lambda t: compiled.cross_entropy(t, targets), logits)
    torch.testing.assert_close(fused, eager)
    assert (
        fused_grad is not None and fused_grad.dtype == torch.bfloat16
    )  # written in the logits' dtype, as the fused backward writes it
    torch.testing.assert_close(fused_grad, eager_grad)


TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}


def _peak(compiled: tuple[str, ...], fields=TINY, ac="selective") -> float:
    from torchfleet.plan import trace

    return trace.trace(fields, trace.Workload(1024, 2, ac, compiled=compiled), world=8).peak


def test_a_compiled_loss_holds_its_logits_once_where_eager_holds_three_fp32_copies():
    """Eager's loss at its backward holds the fp32 log-softmax and two fp32 gradients the size of the logits (12
    bytes a logit beyond the bf16 logits' 2); a fused loss holds the bf16 logits and their bf16 gradient (4). The
    logits (2 x 1024 x 32000) outweigh the tiny blocks, so the peak is there."""
    logits = 2 * 1024 * 32000
    eager, fused = _peak(()), _peak(("loss",))
    print(f"eager {eager:,.0f}, loss compiled {fused:,.0f}: {(eager - fused) / logits:.2f} bytes a logit less")
    assert 7 <= (eager - fused) / logits <= 12


def test_compiled_blocks_hold_less_than_eager_ones_and_the_trace_routes_every_norm_and_mlp():
    """Under full checkpointing the peak is a block's recomputation beside its backward, where eager holds every
    link of its norms and its MLP's activation; compiled, the chains' inputs only."""
    from torchfleet.plan import compiled, library_model

    with torch.device("meta"):
        model = library_model.build(TINY)
    assert compiled.use(model, ("loss",)) == 0
    assert compiled.use(model, ("model",)) == 2 * 2 + 1 + 2  # two norms a block and the final one; two MLPs
    wide = dict(TINY, vocab_size=256)  # the logits small, so a block's backward is the peak
    eager, fused = _peak((), wide, "full"), _peak(("model",), wide, "full")
    print(f"eager {eager:,.0f}, blocks compiled {fused:,.0f}")
    # One MLP's activated gate (bf16, tokens x 1024) is a link a fused chain never holds.
    assert eager - fused >= 2 * 1024 * 1024 * 2


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--compile", "fused"], "--compile component 'fused'"),
        (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
    ],
)
def test_a_component_or_attention_plan_does_not_know_is_refused_in_one_sentence(flags, said):
    from helpers import assert_refused_in_one_sentence, forked_torchfleet

    args = ["--hf-config", "llama-3.1-8b", "--gpu", "H100", "--nodes", "1", "--gpus-per-node", "8", *flags]
    assert_refused_in_one_sentence(forked_torchfleet("plan", *args), said)


def test_a_bare_compile_flag_compiles_the_blocks_and_the_loss_and_the_plan_holds_less(tmp_path):
    """`plan --compile` is torchtitan's default, both components: the workload says so, and the FSDP row holds
    less than the same plan eager, by at least what the fused loss alone saves (7 bytes a logit)."""
    import json

    from helpers import forked_torchfleet

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    docs = {}
    for name, flags in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / f"{name}.json"
        args = ["--hf-config", str(config), "--gpu", "H100", "--nodes", "1", "--gpus-per-node", "8", "--nproc", "8"]
        args += ["--seq-len", "1024", "--local-batch", "2", "--tp", "1", "--json-out", str(out), *flags]
        result = forked_torchfleet("plan", *args, timeout=280)
        assert result.returncode == 0, result.stderr
        docs[name] = json.loads(out.read_text())
    assert docs["compiled"]["workload"]["compile"] == ["model", "loss"] and docs["eager"]["workload"]["compile"] == []
    assert "compiled (model, loss)" in " ".join(docs["compiled"]["notes"])
    peaks = {name: {r["layout"]: r["peak"] for r in doc["rows"]}["FSDP 8"] for name, doc in docs.items()}
    assert peaks["eager"] - peaks["compiled"] >= 7 * 2 * 1024 * 32000
