"""plan --hf-config of models that are not decoders: T5 (an encoder-decoder, traced as transformers'
sequence-to-sequence model) and BERT (an encoder, as its masked language model), on fake tensors like the
decoders, each block of both of T5's stacks its own FSDP unit."""

from __future__ import annotations

import json

import pytest

from helpers import assert_refused_in_one_sentence, forked_torchfleet, require_module

require_module("transformers", "transformers (the test extra) builds the library models from configs")

from torchfleet.plan import library_model  # noqa: E402

# bert-base-uncased's published shape: 12 blocks of width 768, 12 heads, feed-forward 3072, 30,522 tokens.
BERT_BASE = {
    "model_type": "bert",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}
H100S = ["--nodes", "1", "--gpus-per-node", "8", "--gpu", "H100"]


def test_t5_3b_and_bert_base_count_their_published_parameters():
    """T5-3B: 2.85 B with its tied embedding (both stacks, 24 blocks each); BERT-base's masked language model:
    109.5 M. The shipped T5 config is in T5's own names (d_model, num_layers, num_heads), read as the others."""
    t5 = library_model.read_config("t5-3b")
    assert (t5["hidden_size"], t5["num_hidden_layers"], t5["num_attention_heads"]) == (1024, 24, 32)
    assert library_model.kind(t5) == "encoder-decoder" and library_model.kind(BERT_BASE) == "encoder"
    assert library_model.parameter_count(t5) == 2_851_598_336
    assert library_model.parameter_count(BERT_BASE) == 109_514_298
    assert library_model.default_seq(t5) == library_model.default_seq(BERT_BASE) == 512


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_t5_3b_and_a_bert_base_encoder_plan_under_fsdp_on_8_gpus(tmp_path):
    """Both plan on one node of 8 H100s at their 512 tokens, every row fitting; T5's step holds its 2.85 B
    parameters' AdamW state sharded over the GPUs, 16 bytes a parameter (fp32 weights, gradients, 2 moments)."""
    config = tmp_path / "bert.json"
    config.write_text(json.dumps(BERT_BASE))
    for name, params in (("t5-3b", 2_851_598_336), (str(config), 109_514_298)):
        out = tmp_path / "plan.json"
        result = forked_torchfleet("plan", "--hf-config", name, *H100S, "--json-out", str(out), timeout=540)
        assert result.returncode == 0, result.stderr
        doc = json.loads(out.read_text())
        assert doc["parameters"] == params
        rows = {r["layout"]: r for r in doc["rows"]}
        fsdp8 = rows["FSDP 8"]
        print(f"{name}: FSDP 8 {fsdp8['peak'] / 2**30:.2f} GiB, {fsdp8['tokens_per_s_per_gpu']:,.0f} tokens/s")
        assert fsdp8["fits"] and fsdp8["gpus"] == 8
        assert fsdp8["memory"]["optimizer"] == pytest.approx(8 * params / 8, rel=0.01)
        assert fsdp8["tokens_per_s_per_gpu"] > 0
        assert "sequence 512" in result.stdout


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--pp", "2"], "--pp 2: plan cuts a decoder's blocks into stages, and t5 is an encoder-decoder model"),
        (["--tp", "8"], "--tp 8: t5's blocks are not split by plain column and row products"),
        (
            ["--hf-config", "llama-3.1-8b", "--decoder-seq-len", "128"],
            "--decoder-seq-len is an encoder-decoder's (T5's), and llama is a decoder model; leave it out",
        ),
    ],
    ids=["pp", "tp", "decoder-length-of-a-decoder"],
)
def test_what_plan_cannot_split_of_t5_is_one_sentence(args, said):
    assert_refused_in_one_sentence(forked_torchfleet("plan", "--hf-config", "t5-3b", *H100S, *args), said)


def test_a_shorter_decoder_costs_t5_fewer_flops():
    """The decoder writes --decoder-seq-len tokens: at 16 against 64 (the encoder reading 64) its blocks' and
    the output layer's FLOPs shrink, the encoder's do not."""
    from torchfleet.plan import trace

    fields = library_model.read_config("t5-3b")
    flops = {
        d: trace.trace(fields, trace.Workload(seq=64, local_batch=1, decoder_seq=d), 8, layers=2).flops
        for d in (16, 64)
    }
    assert 0 < flops[16] < flops[64]
