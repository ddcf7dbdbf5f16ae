"""The built-in models (torchfleet.models) and their data: sizes, shapes, GPT-2's and
torchvision's structure, the text corpus, and `train`/`bench` with them."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

from helpers import require_module, torchfleet
from torchfleet import cli
from torchfleet.errors import UsageError
from torchfleet.models import GPT, GPT_PRESETS, MODELS, GPTConfig, build_model, lm_loss, resnet18, resnet50
from torchfleet.models.gpt import Attention
from torchfleet.train import text
from torchfleet.train.config import TrainConfig
from torchfleet.train.datasets import MockTokens, builtin_dataset

SMALL = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=48)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied parameter once


# ---- gpt ---------------------------------------------------------------------------------


# gpt2: GPT-2 small's 124,439,808 and its vocabulary's 47 padded rows of 768 (50,257 -> 50,304).
@pytest.mark.parametrize("preset,params", [("tiny", 236_928), ("small50m", 57_294_336), ("gpt2", 124_475_904)])
def test_gpt_preset_parameter_counts(preset, params):
    with torch.device("meta"):  # the shapes without the memory or the initialisation time
        model = build_model("gpt", gpt_preset=preset)
    assert _count(model) == params
    assert set(GPT_PRESETS) == {"tiny", "small50m", "gpt2"}
    assert params >= 50_000_000 or preset == "tiny"  # small50m is for the fsdp memory test


def test_gpt2_preset_is_gpt2_small():
    cfg = GPT_PRESETS["gpt2"]
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (50257, 1024, 12, 12, 768)
    assert cfg.tie_embeddings and cfg.dropout == 0.0
    assert cfg.padded_vocab == 50304  # nanoGPT's: a multiple of 64


def test_a_padded_vocabulary_is_never_predicted():
    """The padded rows are outside the logits: no probability, no loss, no gradient; the first
    vocab_size rows compute what an unpadded GPT with the same weights computes."""
    torch.manual_seed(0)
    padded = GPT(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": True, "vocab_multiple": 64}))
    assert padded.tok_emb.weight.shape[0] == 128 and padded.head.weight is padded.tok_emb.weight
    plain = GPT(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": True}))
    plain.load_state_dict(
        {k: v[: SMALL.vocab_size] if v.shape[0] == 128 else v for k, v in padded.state_dict().items()}
    )
    idx, targets = torch.randint(0, SMALL.vocab_size, (2, 8)), torch.randint(0, SMALL.vocab_size, (2, 8))
    logits = padded(idx)
    assert logits.shape == (2, 8, SMALL.vocab_size)
    assert torch.equal(logits, plain(idx))
    lm_loss(logits, targets).backward()
    grad = padded.tok_emb.weight.grad
    assert grad is not None and grad[SMALL.vocab_size :].abs().max().item() == 0.0
    assert grad[: SMALL.vocab_size].abs().max().item() > 0


def test_tied_embeddings_share_storage():
    tied = GPT(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": True}))
    untied = GPT(SMALL)
    assert tied.head.weight is tied.tok_emb.weight
    assert tied.head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    assert _count(untied) - _count(tied) == SMALL.vocab_size * SMALL.n_embd
    assert untied.head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    lm_loss(tied(torch.randint(0, 97, (2, 8))), torch.randint(0, 97, (2, 8))).backward()
    assert tied.tok_emb.weight.grad is tied.head.weight.grad  # one gradient, from both uses


def test_gpt_forward_shape_and_causality():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
    logits = model(idx)
    assert logits.shape == (2, SMALL.block_size, SMALL.vocab_size) and logits.dtype == torch.float32
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % SMALL.vocab_size
    after = model(changed)
    assert torch.equal(after[:, :20], logits[:, :20])  # the past does not see the future
    assert not torch.allclose(after[:, 20:], logits[:, 20:])
    with pytest.raises(UsageError, match="longer than this GPT's block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_gpt_init_is_gpt2s():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["tiny"])
    assert model.blocks[0].attn.q.weight.std().item() == pytest.approx(0.02, rel=0.05)
    # 2 * 4 layers of residual projections: std 0.02 / sqrt(8)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert model.blocks[0].attn.q.bias.abs().max().item() == 0.0


def test_gpt_matches_hugging_face_gpt2_given_the_same_weights():
    transformers = require_module("transformers", "transformers is in the test extra; not installed")
    hf_cfg = transformers.GPT2Config(
        vocab_size=97,
        n_positions=32,
        n_embd=48,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = GPT(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": True})).eval()
    src = hf.state_dict()
    mine = {
        "tok_emb.weight": src["transformer.wte.weight"],
        "pos_emb.weight": src["transformer.wpe.weight"],
        "norm.weight": src["transformer.ln_f.weight"],
        "norm.bias": src["transformer.ln_f.bias"],
        "head.weight": src["lm_head.weight"],
    }
    for i in range(2):
        h = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            mine[f"blocks.{i}.{ln}.weight"] = src[f"{h}{ln}.weight"]
            mine[f"blocks.{i}.{ln}.bias"] = src[f"{h}{ln}.bias"]
        # HF's Conv1D stores (in, out); c_attn is q, k and v side by side.
        weights, biases = src[h + "attn.c_attn.weight"].t().chunk(3), src[h + "attn.c_attn.bias"].chunk(3)
        for name, w, b in zip("qkv", weights, biases, strict=True):
            mine[f"blocks.{i}.attn.{name}.weight"], mine[f"blocks.{i}.attn.{name}.bias"] = w, b
        for ours_name, hf_name in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            mine[f"blocks.{i}.{ours_name}.weight"] = src[f"{h}{hf_name}.weight"].t()
            mine[f"blocks.{i}.{ours_name}.bias"] = src[f"{h}{hf_name}.bias"]
    ours.load_state_dict(mine)
    idx = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max().item() < 1e-5


def test_tp_plan_names_modules_that_exist():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = GPT(SMALL)
    plan = model.tp_plan()
    modules = dict(model.named_modules())
    assert set(plan) <= set(modules) and len(plan) == 6 * SMALL.n_layer
    for name, style in plan.items():
        kind = RowwiseParallel if name.endswith("proj") else ColwiseParallel
        assert type(style) is kind and isinstance(modules[name], nn.Linear), name


def test_attention_runs_on_a_column_shard_of_its_heads():
    # What tensor parallelism does to one block, by hand: each of 2 ranks holds half the
    # columns of q, k, v (2 of 4 heads) and half the rows of proj; the partial outputs
    # summed (the all-reduce), plus proj's bias once, equal the whole attention's.
    torch.manual_seed(0)
    full = Attention(SMALL).eval()
    x = torch.randn(2, 16, SMALL.n_embd)
    total = full.proj.bias.detach().clone()
    half = SMALL.n_embd // 2
    for rank in range(2):
        cols = slice(rank * half, (rank + 1) * half)
        shard = Attention(SMALL).eval()
        for name in "qkv":
            src, dst = getattr(full, name), nn.Linear(SMALL.n_embd, half)
            dst.weight.data, dst.bias.data = src.weight.data[cols].clone(), src.bias.data[cols].clone()
            setattr(shard, name, dst)
        shard.proj = nn.Linear(half, SMALL.n_embd, bias=False)
        shard.proj.weight.data = full.proj.weight.data[:, cols].clone()
        with torch.no_grad():
            total = total + shard(x)
    with torch.no_grad():
        assert (total - full(x)).abs().max().item() < 1e-5


def test_lm_loss_is_mean_cross_entropy_over_positions():
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = (
        sum(
            nn.functional.cross_entropy(logits[b, t : t + 1], targets[b, t : t + 1]) for b in range(2) for t in range(5)
        )
        / 10
    )
    assert lm_loss(logits, targets).item() == pytest.approx(expected.item(), rel=1e-6)


def test_a_bad_gpt_config_is_one_sentence():
    with pytest.raises(UsageError, match="n_embd=50 does not split into n_head=4 heads"):
        GPTConfig(n_embd=50, n_head=4)
    with pytest.raises(UsageError, match="unknown gpt preset 'huge'; choose one of tiny, small50m, gpt2"):
        build_model("gpt", gpt_preset="huge")


# ---- resnet ------------------------------------------------------------------------------


@pytest.mark.parametrize("build,keys,params", [(resnet18, 122, 11_689_512), (resnet50, 320, 25_557_032)])
def test_resnets_have_torchvisions_size(build, keys, params):
    # torchvision's own figures for 1,000 classes: state-dict entries and parameters.
    with torch.device("meta"):
        model = build(num_classes=1000)
    assert len(model.state_dict()) == keys and _count(model) == params
    names = set(model.state_dict())
    assert {
        "conv1.weight",
        "bn1.running_var",
        "layer1.0.conv1.weight",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.num_batches_tracked",
        "layer4.1.bn2.bias",
        "fc.weight",
        "fc.bias",
    } <= names


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnet_state_dict_equals_torchvisions(name):
    tv = pytest.importorskip(
        "torchvision.models",
        reason="torchvision is not installed (and not needed: this"
        " compares our ResNets with it where a lane happens to have it)",
    )
    theirs = getattr(tv, name)(num_classes=10).state_dict()
    ours = build_model(name, (3, 64, 64), num_classes=10).state_dict()
    assert list(ours) == list(theirs)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnet_forward_shapes(name):
    torch.manual_seed(0)
    model = build_model(name, (3, 64, 64), num_classes=10)
    digits = build_model(name, (1, 8, 8), num_classes=10)  # a 1-channel input replaces conv1's in-channels
    assert digits.conv1.weight.shape == (64, 1, 7, 7)
    with torch.no_grad():
        assert model(torch.rand(2, 3, 64, 64)).shape == (2, 10)
        assert digits(torch.rand(2, 1, 8, 8)).shape == (2, 10)  # adaptive pooling: 8x8 works too


def test_registry_and_the_old_import_path():
    from torchfleet.train import models as old

    assert MODELS == ("mlp", "cnn", "transformer", "gpt", "gpt-moe", "resnet18", "resnet50")
    assert old.build_model is build_model and old.MODELS is MODELS
    assert isinstance(old.build_optimizer("sgd", GPT(SMALL).parameters(), 0.1), torch.optim.SGD)


# ---- data --------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_the_split_disjoint():
    first = text.corpus()
    text.corpus.cache_clear()
    assert text.corpus() == first and 30_000 < len(first) < 200_000
    assert first.startswith(b".. _breast_cancer_dataset:")  # breast_cancer.rst sorts first
    train, val = text.text("train", 64), text.text("val", 64)
    whole = torch.frombuffer(bytearray(first), dtype=torch.uint8).long()
    assert torch.equal(torch.cat([train.tokens, val.tokens]), whole)  # every byte in exactly one split
    assert len(val.tokens) == int(len(whole) * 0.1)
    assert len(train) == (len(train.tokens) - 1) // 64 and len(val) == (len(val.tokens) - 1) // 64
    x, y = train[3]
    assert x.dtype == torch.long and x.shape == y.shape == (64,)
    assert torch.equal(x, whole[192:256]) and torch.equal(y, whole[193:257])
    last_x, last_y = val[len(val) - 1]
    assert torch.equal(last_x[1:], last_y[:-1])
    assert torch.equal(builtin_dataset("text", "val", block_size=64)[0][0], val[0][0])
    with pytest.raises(IndexError):
        val[len(val)]


def test_mock_tokens_are_shifted_by_one():
    inputs, targets = next(iter(MockTokens(4, 16, 50, seed=1)))
    assert inputs.shape == targets.shape == (4, 16) and int(inputs.max()) < 50
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_the_data_follows_the_model():
    assert TrainConfig(model="gpt").data == "text"
    assert TrainConfig().data == "digits" and TrainConfig(model="resnet18").data == "digits"


# ---- the commands ------------------------------------------------------------------------

BAD = [
    (
        ["train", "--model", "gpt", "--data", "digits"],
        "--model gpt reads token sequences but --data digits holds images; use --data text",
    ),
    (
        ["train", "--model", "cnn", "--data", "text"],
        "--data text holds token sequences for --model gpt or gpt-moe, but --model cnn classifies images",
    ),
    (["train", "--model", "gpt", "--gpt-preset", "huge"], "invalid choice: 'huge'"),
    (["bench", "--model", "resnet50", "--image-size", "0"], "--image-size 0 must be at least 1"),
]


@pytest.mark.parametrize("argv,sentence", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_combinations_are_one_sentence(argv, sentence, capsys):
    try:
        status = cli.main(argv)  # in this process: the code a subprocess would run, without its start-up
    except SystemExit as exc:  # argparse's own refusals (an unknown choice)
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and sentence in err[0] and "Traceback" not in err[0], err


@pytest.mark.timeout(120)
def test_train_gpt_reports_validation_loss_and_perplexity(tmp_path):
    out = tmp_path / "result.json"
    result = torchfleet(
        "train",
        "--model",
        "gpt",
        "--strategy",
        "serial",
        "--epochs",
        "1",
        "--max-steps",
        "5",
        "--hang-timeout",
        "0",
        "--json-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert figures["model"] == "gpt" and figures["data"] == "text" and figures["gpt_preset"] == "tiny"
    assert figures["steps"] == 5 and "val_accuracy" not in figures
    # A fresh model guesses among 256 bytes: loss ln 256 = 5.55. Five steps bring it well below.
    assert figures["final_loss"] < math.log(256) - 0.3 and figures["val_loss"] < math.log(256) - 0.3
    assert figures["val_perplexity"] == pytest.approx(math.exp(figures["val_loss"]), rel=1e-9)
    assert figures["tokens_per_s"] == pytest.approx(figures["samples_per_s"] * 64, rel=1e-9)
    line = re.search(r"epoch 1: validation loss ([\d.]+), perplexity ([\d.]+)", result.stdout)
    assert line and float(line.group(1)) == pytest.approx(figures["val_loss"], abs=1e-4), result.stdout
    assert "validation perplexity" in result.stdout  # the summary's row
