"""Models built on the meta device and pretrained weights read shard by shard (torchfleet/weights/).

One launch of 2 processes and one of 4 run every case (tests/weights_jobs.py); each case builds a zoo
model with `fleet.init_module()` and sets it up under a strategy:

- from scratch: fsdp's, tp's, pipeline's and ddp's initial weights equal serial's, bit for bit (every layout
  copies its share out of the same whole tensors);
- from a directory that transformers' save_pretrained wrote (Llama, Qwen2-MoE with its experts one per
  key, a peft-wrapped Llama with an adapter directory): logits equal those of one process's
  from_pretrained within 1e-6 (hsdp too), each rank having taken less than all of the files where it holds a
  share (fsdp), mapping the shares that are one run of a file's bytes rather than reading them, and again
  after save_model(DIR) and from_pretrained(DIR), also when DIR is the directory the weights are mapped from.

Measured on 2 loaded cores with torch 2.14: logits at most 1.3e-7 from from_pretrained's (tp's
row-wise sums), 0 elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchfleet import launch
from torchfleet.versions import release
from weights_jobs import INPUTS, build, cases_job

LOGITS_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    """The models' directories as transformers and peft write them, and each one's logits from one process."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import zoo

    root = tmp_path_factory.mktemp("weights")
    out = {"root": root}
    for name in ("llama", "qwen2-moe"):
        build(name).save_pretrained(root / name)
        loaded = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32).eval()
        with torch.no_grad():
            out[name] = loaded(input_ids=INPUTS).logits
    tied = build("llama-tied")  # its head saved beside the embedding it is tied to, as some checkpoints hold it
    tied.config.save_pretrained(root / "llama-tied")
    state = {k: v.contiguous().clone() for k, v in tied.state_dict().items()}
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    save_file(state, root / "llama-tied" / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        out["llama-tied"] = tied.eval()(input_ids=INPUTS).logits
    base = AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32)
    adapted = get_peft_model(base, LoraConfig(target_modules=zoo.LORA_TARGETS))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:  # peft starts them at zero: the adapters would change nothing
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        adapted.save_pretrained(root / "lora")
        out["peft-llama"] = (
            PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32), root / "lora"
            )
            .eval()(input_ids=INPUTS)
            .logits
        )
    return out


def _cases(dirs: dict, loads: list[tuple[str, str]], scratch: list[str]) -> list[tuple]:
    cases = [(s, "llama", None, None, None) for s in scratch]
    for strategy, name in loads:
        base = dirs["root"] / (name if name in ("qwen2-moe", "llama-tied") else "llama")
        adapters = dirs["root"] / "lora" if name == "peft-llama" else None
        cases.append((strategy, name, str(base), adapters and str(adapters), str(dirs["root"] / f"{strategy}-{name}")))
    return cases


TWO_LOADS = [
    ("fsdp", "llama"),
    ("tp", "llama"),
    ("pipeline", "llama"),
    ("fsdp", "qwen2-moe"),
    ("ep", "qwen2-moe"),
    ("pipeline", "qwen2-moe"),
    ("tp", "qwen2-moe"),  # experts split by tp (a strided shard of the packed gate and up halves)
    ("fsdp", "peft-llama"),
    ("tp", "peft-llama"),
    ("pipeline", "peft-llama"),
    ("pipeline", "llama-tied"),  # the head on the last stage, read under its embedding's key or its own
]
FOUR_LOADS = [
    ("fsdp+tp", "llama"),
    ("hsdp", "llama"),
    ("fsdp+ep", "qwen2-moe"),
    ("fsdp+tp", "peft-llama"),
    ("fsdp+tp", "qwen2-moe"),
]
SCRATCH = ["fsdp", "tp", "pipeline", "ddp"]  # ddp holds the model whole: it is made whole before ddp wraps it


def _by_case(results: list[list[dict]], cases: list[tuple]) -> dict:
    """{(strategy, model, weights?): every rank's result}, failures raised with their traceback."""
    out = {}
    for i, case in enumerate(cases):
        per_rank = [rank[i] for rank in results]
        for got in per_rank:
            assert "error" not in got, f"{case[:2]} failed:\n{got['error']}"
        out[case[0], case[1], case[2] is not None, case[3] is not None] = per_rank
    return out


@pytest.fixture(scope="module")
def two(dirs):
    fresh = ("tp", "peft-llama", str(dirs["root"] / "llama"), None, None)  # base weights read, adapters fresh
    cases = [*_cases(dirs, TWO_LOADS, SCRATCH), ("pipeline", "dict-out", None, None, None), fresh]
    return _by_case(launch(cases_job, nprocs=2, args=(cases,)), cases)


@pytest.fixture(scope="module")
def four(dirs):
    cases = _cases(dirs, FOUR_LOADS, [])
    return _by_case(launch(cases_job, nprocs=4, args=(cases,)), cases)


def test_a_model_built_on_meta_starts_from_the_same_weights_under_every_layout(two):
    from torchfleet import Fleet

    fleet = Fleet(strategy="serial")
    with fleet.init_module():
        net = build("llama")
    model, _ = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    serial = model.state_dict()
    assert all(v.device.type == "cpu" and v.isfinite().all() for v in serial.values())
    assert 0.015 < serial["model.layers.0.mlp.up_proj.weight"].std() < 0.025  # Llama's own: normal, std 0.02
    assert (serial["model.norm.weight"] == 1).all()
    for strategy in SCRATCH:
        state = two[strategy, "llama", False, False][0]["state"]
        assert list(state) == list(serial)
        for key, value in serial.items():
            assert torch.equal(state[key], value), f"{strategy}: {key} differs from serial's initial value"


def _logits(per_rank: list[dict]) -> torch.Tensor:
    return next(r["logits"] for r in per_rank if r["logits"] is not None)  # a pipeline's last stage has them


@pytest.mark.parametrize("strategy, name", TWO_LOADS + FOUR_LOADS)
def test_pretrained_weights_load_shard_by_shard_and_save_back(request, dirs, strategy, name):
    from transformers import AutoModelForCausalLM

    launched = request.getfixturevalue("four" if (strategy, name) in FOUR_LOADS else "two")
    per_rank = launched[strategy, name, True, name == "peft-llama"]
    if "tp" in strategy and name == "qwen2-moe" and release() < (2, 14):  # tp of experts: refused there
        assert all("as a strided shard, which torch 2.1" in rank["refused"] for rank in per_rank), per_rank
        return
    diff = (_logits(per_rank) - dirs[name]).abs().max().item()
    assert diff < LOGITS_TOLERANCE, f"{strategy} on {name}: logits {diff:.3g} from from_pretrained's"
    if strategy in ("fsdp", "hsdp", "fsdp+tp", "fsdp+ep"):  # each rank read its share, not the files
        for rank in per_rank:
            assert rank["read"] < 0.75 * rank["files"], (
                f"{strategy}: a rank read {rank['read']} of {rank['files']} bytes"
            )
    saved = dirs["root"] / f"{strategy}-{name}"
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    if name == "peft-llama":
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(reloaded, saved / "adapter").eval()
    with torch.no_grad():
        diff = (reloaded(input_ids=INPUTS).logits - dirs[name]).abs().max().item()
    assert diff < LOGITS_TOLERANCE, f"{strategy} on {name}: saved and reloaded, logits {diff:.3g} off"


def test_each_rank_holds_and_reads_its_share(two):
    """The mechanism of benchmarks/weights_memory.py's figures: under fsdp a rank of 2 holds half the
    parameters and takes about half the bytes; under tp the split layers' half and the rest whole.
    Every tensor of the tiny Llama splits evenly in two, so fsdp's and the pipeline's shares are one run of the
    file's bytes each: mapped, none read (their logits equal from_pretrained's in the test above). tp alone maps
    its column-split shares too, as views over their rows."""
    fsdp, tp, pipeline = (two[s, "llama", True, False] for s in ("fsdp", "tp", "pipeline"))
    whole = sum(v.numel() * 4 for v in fsdp[0]["state"].values())
    for rank in fsdp:
        assert math.isclose(rank["held"], whole / 2, rel_tol=0.05)
        assert rank["read"] + rank["mapped"] <= 0.55 * rank["files"]
        assert rank["read"] == 0 and rank["mapped"] == rank["held"]
    for rank in pipeline:
        assert rank["read"] == 0 and rank["mapped"] == rank["held"]
    for rank in tp:
        assert rank["held"] < 0.8 * whole
        # row-split shares mapped as runs, column-split ones as strided views over their rows' mapping: none read
        assert rank["read"] == 0 and rank["held"] < rank["mapped"] < whole


def test_saving_over_the_mapped_directory_keeps_the_weights_in_use(dirs, tmp_path):
    """The base weights stay mapped from the directory's files while save_model replaces that directory: it
    writes a new one and renames it over the old, whose files live on unlinked, so the frozen weights do not
    change under the model; the step's writes to the mapped adapters stay in the process."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from weights_jobs import save_over_job

    shutil.copytree(dirs["root"] / "llama", tmp_path / "base")
    shutil.copytree(dirs["root"] / "lora", tmp_path / "lora")
    ranks = launch(save_over_job, nprocs=2, args=(str(tmp_path / "base"), str(tmp_path / "lora")))
    for rank in ranks:
        assert rank["mapped"] > 0 and rank["read"] == 0, rank
        assert rank["adapter_file_kept"]
        assert (rank["start"] - dirs["peft-llama"]).abs().max() < LOGITS_TOLERANCE
        assert (rank["before"] - rank["start"]).abs().max() > 1e-4  # the step moved the adapters
        assert torch.equal(rank["after"], rank["before"])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(reloaded, tmp_path / "base" / "adapter").eval()
    with torch.no_grad():
        diff = (reloaded(input_ids=INPUTS).logits - ranks[0]["before"]).abs().max().item()
    assert diff < LOGITS_TOLERANCE, f"saved over its own directory, reloaded: logits {diff:.3g} off"


def test_a_meta_model_a_pipeline_must_trace_is_refused_in_one_sentence(two):
    for rank in two["pipeline", "dict-out", False, False]:
        said = rank["refused"]
        assert "meta device" in said and "tracing" in said and "\n" not in said


def _setup_serial(name: str, weights, meta: bool = True, **given):
    from torchfleet import Fleet

    fleet = Fleet(strategy="serial")
    if meta:
        with fleet.init_module():
            net = build(name)
    else:
        net = build(name)
    return fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), weights=weights, **given)[0]


def _one_sentence(match: str, name: str, weights, **given) -> str:
    from torchfleet.errors import UsageError

    with pytest.raises(UsageError, match=match) as caught:
        _setup_serial(name, weights, **given)
    said = str(caught.value)
    assert "\n" not in said and said.count("; ") <= 2, said
    return said


def test_bad_directories_are_refused_in_one_sentence_each(tmp_path):
    from safetensors.torch import save_file

    model = build("llama")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    _one_sentence(r"holds neither model\.safetensors nor model\.safetensors\.index\.json", "llama", tmp_path / "empty")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    said = _one_sentence(r"names model-00002-of-\d+\.safetensors, which is not there", "llama", tmp_path / "sharded")
    assert "copy the whole directory" in said
    for case, changed in {
        "extra": {**state, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)},
        "shape": {**state, "model.norm.weight": torch.ones(7)},
        "dtype": {**state, "model.norm.weight": torch.ones(32, dtype=torch.int64)},
        "missing": {k: v for k, v in state.items() if k != "lm_head.weight"},
    }.items():
        (tmp_path / case).mkdir()
        save_file(changed, tmp_path / case / "model.safetensors", metadata={"format": "pt"})
    _one_sentence(
        r"holds model\.layers\.9\.mlp\.up_proj\.weight, which this model does not have", "llama", tmp_path / "extra"
    )
    _one_sentence(
        r"holds model\.norm\.weight of shape \[7\] and this model's model\.norm\.weight is \[32\]",
        "llama",
        tmp_path / "shape",
    )
    _one_sentence(
        r"holds model\.norm\.weight as torch\.int64 and this model's model\.norm\.weight is torch\.float32, which cannot take it",
        "llama",
        tmp_path / "dtype",
    )
    _one_sentence(r"holds no weight for this model's lm_head\.weight \(\[64, 32\]\)", "llama", tmp_path / "missing")
    # the same directory loads into a model built with its memory too, not only one built on meta
    model.save_pretrained(tmp_path / "whole")
    loaded = _setup_serial("llama", tmp_path / "whole", meta=False)
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())


def test_a_meta_module_with_no_initialisation_is_refused_in_one_sentence():
    from torch import nn

    from torchfleet import Fleet
    from torchfleet.errors import UsageError

    class Scale(nn.Module):  # a parameter set in __init__, which a meta build leaves without values
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    fleet = Fleet(strategy="serial")
    with fleet.init_module():
        net = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(
        UsageError, match=r"^1\.gain \(Scale\) has no initialisation to run on the meta device"
    ) as caught:
        fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert "\n" not in str(caught.value)


BYTE_LLAMA = """
from transformers import LlamaConfig, LlamaForCausalLM


def build():  # a language model over bytes, the built-in text's tokens
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32)
    return LlamaForCausalLM(config)
"""


@pytest.mark.timeout(480)  # several trainings: 86 s in CI's two lanes, over 180 s with five pytest runs beside
def test_train_runs_the_built_in_loop_on_a_hugging_face_directory_and_on_a_builder(tmp_path):
    import json
    import sys

    from transformers import AutoModelForCausalLM

    from helpers import assert_refused_in_one_sentence, forked_torchfleet, torchfleet

    (tmp_path / "bytes_model.py").write_text(BYTE_LLAMA)
    sys.path.insert(0, str(tmp_path))
    try:
        import bytes_model

        bytes_model.build().save_pretrained(tmp_path / "start")
    finally:
        sys.path.remove(str(tmp_path))
    steps = ("--max-steps", "2", "--batch-size", "8", "--no-progress")
    result = torchfleet(
        "train", "--hf-model", str(tmp_path / "start"), "--strategy", "fsdp", "-n", "2", *steps,
        "--save-model", str(tmp_path / "tuned"), "--json-out", str(tmp_path / "tuned.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "tuned.json").read_text())["steps"] == 2
    start, tuned = (AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32) for d in ("start", "tuned"))
    moved = [k for k, v in tuned.state_dict().items() if not torch.equal(v, start.state_dict()[k])]
    assert "model.layers.1.mlp.down_proj.weight" in moved  # trained from the directory's weights, and saved
    # tp maps its column-split shares as strided views over the files; the optimizer's writes copy their pages
    # privately, the files unchanged, and the steps are serial's.
    for strategy in ("tp", "serial"):
        result = torchfleet(
            "train", "--hf-model", str(tmp_path / "start"), "--strategy", strategy, "-n", "2" if strategy == "tp" else "1",
            *steps, "--save-model", str(tmp_path / strategy),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    by_tp, by_serial = (
        AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32) for d in ("tp", "serial")
    )
    gaps = {k: (v - by_serial.state_dict()[k]).abs().max().item() for k, v in by_tp.state_dict().items()}
    assert max(gaps.values()) < 1e-5 and gaps["model.layers.1.mlp.down_proj.weight"] < 1e-5, gaps
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "start", dtype=torch.float32)
    assert all(torch.equal(v, start.state_dict()[k]) for k, v in again.state_dict().items())  # the files unchanged
    from torchfleet.train.config import TrainConfig
    from torchfleet.train.loop import train

    built = train(  # --model MODULE:FUNCTION, in this process
        TrainConfig(model=f"{tmp_path / 'bytes_model.py'}:build", max_steps=2, batch_size=8, progress=False), "serial"
    )
    assert built["steps"] == 2 and built["final_loss"] < 6.0  # about ln 256 = 5.5 at the start
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "start" / "config.json").read_text())
    result = forked_torchfleet("train", "--hf-model", str(tmp_path / "bare"), "--strategy", "serial", *steps)
    assert_refused_in_one_sentence(result, "holds neither model.safetensors nor model.safetensors.index.json")


def test_commands_that_need_transformers_name_the_extra_where_it_is_missing(monkeypatch, tmp_path):
    import sys

    from torchfleet import Fleet
    from torchfleet.errors import UsageError
    from torchfleet.plan import library_model
    from torchfleet.train import own_model

    monkeypatch.setitem(sys.modules, "transformers", None)  # as in the venv `make demo` makes
    with pytest.raises(UsageError, match=r"^--hf-config needs transformers .* pip install 'torchfleet\[hf\]'$"):
        library_model.parameter_count(library_model.read_config("llama-3.1-8b"))
    with pytest.raises(UsageError, match=r"^--hf-model needs transformers .* pip install 'torchfleet\[hf\]'$"):
        own_model.build(Fleet(strategy="serial"), str(tmp_path), "cnn")


def test_a_peft_model_reads_its_base_weights_and_starts_its_adapters_as_peft_does(two, dirs):
    """Without an adapter directory the adapters start as peft starts them (B zero): the base model's logits."""
    per_rank = two["tp", "peft-llama", True, False]
    diff = (_logits(per_rank) - dirs["llama"]).abs().max().item()
    assert diff < LOGITS_TOLERANCE, f"fresh adapters moved the base model's logits by {diff:.3g}"
    state = next(r["state"] for r in per_rank if r["state"])
    a = [v for k, v in state.items() if "lora_A" in k]
    b = [v for k, v in state.items() if "lora_B" in k]
    assert a and all(v.abs().max() > 0 for v in a) and all((v == 0).all() for v in b)


def test_a_key_map_reads_a_directory_under_other_names(tmp_path):
    from safetensors.torch import save_file

    model = build("llama")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file({f"decoder/{k}": v for k, v in state.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = _setup_serial("llama", tmp_path, key_map=lambda key: f"decoder/{key}")
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    bad = {**{k: f"decoder/{k}" for k in state}, "model.norm.weight": "norm"}
    _one_sentence(r"key_map maps model\.norm\.weight to norm, which .* does not hold", "llama", tmp_path, key_map=bad)
