"""Models other people wrote, at their libraries' defaults, through every strategy (tests/zoo.py).

Each cell trains 5 SGD steps and must equal serial's weights within 1e-5, or
be refused before training in one sentence; what save_model wrote must load
strictly into a fresh copy of the model; a peft model's adapters saved alone must
load through PeftModel.from_pretrained into the model it adapts, giving the trained
model bit for bit. Measured on 2 CPU cores with torch 2.14.1: every cell within
1.2e-7 of serial (most 4e-9 to 8e-9, the MoE models' too), no refusal but those of
REFUSED, which every torch makes by design.
Before 2.14 torch cannot train through a pipeline that sends an integer or
bool tensor between stages (GPT-2's and BERT's masks): those cells are the
expected refusals there.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from helpers import require_module, whole_grids
from torchfleet import launch
from torchfleet.versions import release

require_module("transformers", "transformers (the test extra) builds the library models from configs")

from zoo import (  # noqa: E402 (after the skip: zoo imports transformers lazily)
    ADAPTERS_TP_REFUSES,
    FAMILIES,
    IDLE_EXPERT,
    PEFT_BASES,
    ZOO,
    checkpoint_job,
    fsdp_traffic_job,
    train_zoo,
    zoo_matrix,
)

IDLE = "hf-mixtral-idle-expert"  # ddp only: what it checks is that DDP needs nothing for an expert without tokens
# The families beyond Llama run where they once failed: pipeline (the output path after the layers) and tp (their
# plans' styles); under ddp and fsdp they equalled serial from the start (issue 56's walk), so they are not run there.
MODELS = [m for m in ZOO if m != IDLE and m not in FAMILIES and m not in ADAPTERS_TP_REFUSES]
PIPELINE_FAMILIES = ["hf-gemma2", "hf-cohere", "hf-gpt-neox"]
TP_FAMILIES = ["hf-qwen3", "hf-gemma3", "hf-phi3", "hf-olmo2", "hf-gpt-neox", "hf-qwen3-moe"]
# The zoo's models that declare a tensor-parallel plan; peft's LoRA models split their adapters with their layers.
PLANNED = ["hf-llama", "hf-llama-tied", *(m for m in ("peft-llama", "peft-qwen2") if m in ZOO)]
# The mixtures of experts with the router's load-balancing loss on: not linear in the batch, made global
# over the data-parallel ranks (strategies/moe_balance.py); under hsdp on 4 processes, over both of its dimensions.
ROUTER_LOSS = ["hf-mixtral-aux", "hf-qwen2-moe-aux"]
# The data-parallel and pipeline strategies every model in MODELS runs under, on 2 processes and on 4: the grid.
GRID = (("ddp", "fsdp", "pipeline"), ("ddp+pipeline", "fsdp+pipeline"))
TWO = [(s, m) for s in GRID[0] for m in MODELS] + [("tp", m) for m in PLANNED]
TWO += [("tp", "hf-mixtral"), ("ddp", IDLE)]
TWO += [("pipeline", m) for m in PIPELINE_FAMILIES] + [("tp", m) for m in TP_FAMILIES]
TWO += [("tp", m) for m in ADAPTERS_TP_REFUSES if m in ZOO]
FOUR = [(s, m) for s in GRID[1] for m in MODELS] + [("fsdp+tp", m) for m in PLANNED]
FOUR += [("fsdp+tp", "hf-qwen2-moe")] + [("hsdp", m) for m in ROUTER_LOSS]  # a cell is one strategy's, on 2 or 4
FOUR += [("fsdp+tp", m) for m in (*TP_FAMILIES, "hf-mixtral")]
FOUR += [("hsdp", m) for m in PEFT_BASES if m in ZOO]  # LoRA on FSDP2's 2-D mesh
FOUR += [("hsdp", m) for m in ("hf-mixtral", "hf-qwen2-moe")]  # replicas of shards: both data parallelisms on 4
ADAPTED = [(s, m) for s, m in TWO + FOUR if m in PEFT_BASES]
# Refused on every torch, by design: the words each sentence must hold. A pipeline's last stage never sees the
# routers; tp splits layers with LoRA adapters only.
REFUSED = {
    **{("tp", m): (kind, "ddp, fsdp, hsdp and pipeline") for m, kind in ADAPTERS_TP_REFUSES.items()},
    **{
        (s, m): ("output_router_logits=False",)
        for s in ("pipeline", "ddp+pipeline", "fsdp+pipeline")
        for m in ROUTER_LOSS
    },
}
# Before 2.14, torch's schedules send a gradient back for every tensor a stage receives
# (strategies/pipeline/cutting.py refuses such cuts by name); from 2.14 on nothing is refused.
OLD_TORCH_REFUSAL = "which torch 2.1"
# Before 2.14, DTensor cannot gather the strided shard tp splits an experts' packed gate and up halves into.
STRIDED_REFUSAL = "as a strided shard, which torch 2.1"
# GRID is the bulk of the cells, each model through torchfleet's same code under each. `make test` (CI) trains
# every cell outside the grid (the families, tp's plans, the experts, the refusals) but WHOLE_GRIDS_ONLY, and the
# grid's cells the tests below read; `make test-all` and a bare pytest train every cell. On torch 2.14.1 every
# cell took 1,084 CPU-seconds on 30 Nov, over a quarter of the suite. CI's floor lane (--floor-lane) trains what
# moves between torch releases: the refusals, and the 2-process cells outside the grid (pipeline's families and
# masks, tp's plans and experts).
# Cells the tests below read beside their own.
READ = [("pipeline", "hf-llama"), ("pipeline", "hf-gpt2"), ("fsdp", "adapters"), ("tp", "hf-llama")]
READ += [("fsdp+tp", "hf-llama")]
# 4-process cells `make test` leaves to the whole grids (9 of the sample's 22 on 30 Nov): fsdp+tp
# on the families, whose tp plans the 2-process cells check and which equalled serial under fsdp from the start
# (fsdp+tp keeps hf-llama's, peft's and hf-qwen2-moe's), and hsdp on the MoE models whose router-loss twins
# (ROUTER_LOSS) run under hsdp in the sample.
WHOLE_GRIDS_ONLY = {("fsdp+tp", m) for m in (*TP_FAMILIES, "hf-mixtral")} | {
    ("hsdp", "hf-mixtral"),
    ("hsdp", "hf-qwen2-moe"),
}


def chosen(config) -> list[tuple[str, str]]:
    """The cells this run trains: all of them, or the samples above."""
    cells = TWO + FOUR
    if whole_grids(config):
        return cells
    grid = {(s, m) for row in GRID for s in row for m in MODELS}
    kept = set(READ) | set(REFUSED)
    if config.getoption("floor_lane"):
        return [c for c in cells if c in kept or (c in TWO and c not in grid)]
    return [c for c in cells if (c not in grid or c in kept) and c not in WHOLE_GRIDS_ONLY]


def pytest_generate_tests(metafunc) -> None:
    cells = chosen(metafunc.config)
    if metafunc.function.__name__ == "test_each_cell_equals_serial_or_is_refused_in_one_sentence":
        metafunc.parametrize("strategy, model", cells)
    elif metafunc.function.__name__ == "test_the_adapters_alone_load_through_peft_from_pretrained":
        metafunc.parametrize("strategy, model", [c for c in ADAPTED if c in cells])


@functools.lru_cache(maxsize=None)
def _serial(name: str) -> dict:
    return train_zoo("serial", name)["weights"]


@pytest.fixture(scope="module")
def cells(tmp_path_factory, request) -> dict:
    """Every chosen (strategy, model) cell's result and saved file: one launch of 2 processes, one of 4."""
    assert len(set(TWO + FOUR)) == len(TWO + FOUR), "a cell is one strategy on one model: its result is kept by that"
    out = tmp_path_factory.mktemp("zoo")
    found = {}
    trained = chosen(request.config)
    for nprocs, grid in ((2, TWO), (4, FOUR)):
        jobs = [
            (s, m, {"save_to": str(out / f"{s}-{m}.pt"), "memory": s == "fsdp"}) for s, m in grid if (s, m) in trained
        ]
        for s, m, options in jobs:
            if m in PEFT_BASES:  # and the adapters alone, as peft's save_pretrained writes them
                options["adapters_to"] = str(out / f"{s}-{m}-adapters")
        results = launch(zoo_matrix, nprocs=nprocs, args=(jobs,))
        assert all(r is None for rank in results[1:] for r in rank)  # only the main rank reports
        for (s, m, options), got in zip(jobs, results[0], strict=True):
            found[s, m] = (got, options["save_to"])
    return found


def _max_diff(want: dict, got: dict) -> float:
    assert list(got) == list(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    return max((want[k] - got[k]).abs().max().item() for k in want)


@pytest.mark.timeout(900)
def test_each_cell_equals_serial_or_is_refused_in_one_sentence(cells, strategy, model):
    got, saved = cells[strategy, model]
    if "refused" in got:
        print(f"{strategy} on {model}: {got['refused']}")
        sentence = got["refused"]
        assert "\n" not in sentence and sentence.endswith(tuple("abcdefghijklmnopqrstuvwxyz)")), sentence
        if (strategy, model) in REFUSED:
            assert all(word in sentence for word in REFUSED[strategy, model]), sentence
            return
        old_torch = OLD_TORCH_REFUSAL if "pipeline" in strategy else STRIDED_REFUSAL
        assert release() < (2, 14) and old_torch in sentence, sentence
        return
    assert (strategy, model) not in REFUSED, f"{strategy} on {model} trained; it should be refused"
    diff = _max_diff(_serial(model), got["weights"])
    assert diff < 1e-5, f"{strategy} on {model}: max weight difference {diff:.3g} from serial"
    fresh = ZOO[model].build()  # what save_model wrote loads strictly into the model it came from
    fresh.load_state_dict(torch.load(saved, weights_only=True), strict=True)
    assert _max_diff(fresh.state_dict(), got["weights"]) == 0.0


@pytest.mark.timeout(300)
def test_the_adapters_alone_load_through_peft_from_pretrained(cells, strategy, model, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    got, saved = cells[strategy, model]
    directory = Path(saved.removesuffix(".pt") + "-adapters")  # the fixture's adapters_to
    torch.manual_seed(0)  # the base model's weights, as the zoo built them before peft wrapped it
    loaded = PeftModel.from_pretrained(PEFT_BASES[model](), directory).eval()
    # The base model's frozen weights and the adapters read back from the file: the trained model, bit for bit.
    assert _max_diff(got["weights"], {k: v.float() for k, v in loaded.state_dict().items()}) == 0.0
    trained = ZOO[model].build().eval()
    trained.load_state_dict(_serial(model), strict=True)
    inputs, _ = ZOO[model].batch(8, 99)
    with torch.no_grad():
        diff = (loaded(**inputs).logits - trained(**inputs).logits).abs().max().item()
    assert diff < 1e-5, f"{strategy} on {model}: logits {diff:.3g} from serial's trained model's"
    trained.save_pretrained(tmp_path)  # what peft itself writes, from the model on one process
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in tmp_path.iterdir())
    ours, peft_own = (load_file(d / "adapter_model.safetensors") for d in (directory, tmp_path))
    assert list(ours) == list(peft_own)
    assert _config(directory) == _config(tmp_path)


def _config(directory: Path) -> dict:
    config = json.loads((directory / "adapter_config.json").read_text())
    return {**config, "target_modules": sorted(config["target_modules"])}  # a set, in the hash seed's order


def test_an_adapters_only_save_of_a_model_without_adapters_is_refused_in_one_sentence(tmp_path):
    from torchfleet import Fleet
    from torchfleet.errors import UsageError

    fleet = Fleet(strategy="serial")
    net = ZOO["dict-out"].build()
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    with pytest.raises(UsageError, match=r"^save_model\(adapters_only=True\) saves peft's adapters and this model"):
        fleet.save_model(tmp_path / "adapters", adapters_only=True)
    assert not (tmp_path / "adapters").exists()


def test_serial_training_moved_every_trainable_weight_and_no_frozen_one():
    for name in MODELS:
        torch.manual_seed(0)
        start = ZOO[name].build()
        trains = {n for n, p in start.named_parameters(remove_duplicate=False) if p.requires_grad}
        start = start.state_dict()
        after = _serial(name)
        for key, value in after.items():
            moved = (value - start[key].float()).abs().max().item()
            # A bias behind a frozen layer may stay. LoRA's A is trained through B, which peft starts at zero: in
            # 5 steps its change (1e-9 here) can fall below float32's resolution; B must move.
            if key in trains and not key.endswith("bias") and ".lora_A." not in key:
                assert moved > 0, f"{name}: {key} did not train"
            elif key not in trains and key in dict(ZOO[name].build().named_parameters(remove_duplicate=False)):
                assert moved == 0, f"{name}: frozen {key} moved by {moved:.3g}"


def test_llama_is_cut_by_its_own_plans(cells):
    if "refused" in cells["pipeline", "hf-llama"][0]:
        pytest.skip("this torch refuses the cut")
    assert any("own pipeline plan" in n for n in cells["pipeline", "hf-llama"][0]["notes"])
    for strategy in ("tp", "fsdp+tp"):
        assert any("base_model_tp_plan" in n for n in cells[strategy, "hf-llama"][0]["notes"])
    gpt2 = cells["pipeline", "hf-gpt2"][0]  # GPT-2 declares no plan: traced (refused before 2.14, its mask)
    assert "refused" in gpt2 or not any("pipeline plan" in n for n in gpt2["notes"])


def test_the_router_loss_is_counted_over_every_data_parallel_rank(cells):
    # Each rank's own load-balancing loss, averaged, was 8.6e-5 (Mixtral) and 1.2e-4 (Qwen2-MoE, ragged
    # padding) off serial's weights on 2 processes, 3.6e-4 and 2.6e-4 on 4; the cell test holds them to 1e-5.
    for strategy, model in [(s, m) for s, m in cells if m in ROUTER_LOSS and (s, m) not in REFUSED]:
        notes = cells[strategy, model][0]["notes"]
        assert any("load-balancing loss counts the expert picks" in n for n in notes), (strategy, model, notes)


def test_an_expert_that_gets_no_tokens_needs_nothing_from_ddp(cells):
    """transformers 5 keeps a layer's experts in two 3-D parameters (gate_up_proj, down_proj), which
    every forward uses: an expert without tokens is a slice whose gradient is zero, not a parameter
    without a gradient, so DDP's reducer finishes every bucket and ddp's check for unused parameters
    (strategies/ddp.py) passes without find_unused_parameters. The zoo's model steers every token
    away from one expert in every layer (zoo.hf_mixtral_idle_expert); the cell test holds ddp's
    weights to serial's, and here that expert's slices stay exactly as built while the others train."""
    torch.manual_seed(0)
    start = ZOO[IDLE].build().state_dict()
    for weights in (_serial(IDLE), cells["ddp", IDLE][0]["weights"]):
        experts = [k for k in start if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert len(experts) == 8
        for key in experts:
            moved = (weights[key] - start[key]).flatten(1).abs().amax(dim=1)
            assert moved[IDLE_EXPERT] == 0, f"{key}: the idle expert moved by {moved[IDLE_EXPERT]:.3g}"
            assert (moved[:IDLE_EXPERT] > 0).all(), f"{key}: an expert with tokens did not train"


def test_fsdp_counts_gradients_and_optimizer_state_of_trainable_parameters_only(cells):
    torch.manual_seed(0)
    net = ZOO["adapters"].build()
    trainable = sum(p.numel() * 4 for p in net.parameters() if p.requires_grad)
    every = sum(p.numel() * 4 for p in net.parameters())
    report = cells["fsdp", "adapters"][0]["memory"]
    grads = sum(rank["grads"] for rank in report.values())
    optimizer = sum(rank["optimizer"] for rank in report.values())
    assert trainable * 0.9 <= grads <= trainable * 1.1, f"{grads} bytes of gradients for {trainable} trainable"
    assert optimizer == 0  # plain SGD keeps no state: nothing for frozen parameters either
    assert sum(rank["params"] for rank in report.values()) >= every * 0.9  # the frozen ones are still held


@pytest.mark.timeout(180)
@pytest.mark.skipif(release() < (2, 14), reason="torch before 2.14 cannot train through BERT's cut (its mask)")
def test_a_traced_stage_checkpoints_only_the_models_own_keys(tmp_path):
    # BERT's tracer adds its non-persistent position_ids and token_type_ids as entries of a stage.
    got = launch(checkpoint_job, nprocs=2, args=("pipeline", "hf-bert", str(tmp_path)))[0]
    own = set(ZOO["hf-bert"].build().state_dict())
    assert got["keys"] and set(got["keys"]) <= own, sorted(set(got["keys"]) - own)
    assert _max_diff(got["saved"], got["loaded"]) == 0.0  # and it loads back exactly


@pytest.mark.timeout(300)
def test_under_fsdp_only_trainable_parameters_get_gradients_optimizer_state_and_reduce_scatters():
    # The optimizer is handed every parameter, frozen ones too, as a careless fine-tuning script would.
    # peft's LoRA Llama, and the zoo's own adapters (no peft needed: the torch floor runs it too).
    names = [m for m in ("peft-llama", "adapters") if m in ZOO]
    found = launch(fsdp_traffic_job, nprocs=2, args=(names,))[0]
    for name in names:
        got = found[name]
        torch.manual_seed(0)
        net = ZOO[name].build()
        trainable = {n: p for n, p in net.named_parameters() if p.requires_grad}
        assert trainable and len(trainable) < len(dict(net.named_parameters()))
        assert name != "peft-llama" or all(".lora_" in n for n in trainable)
        assert got["trainable"] == sorted(trainable)
        assert got["with_grad"] == sorted(trainable)  # a frozen parameter's grad stays None
        assert got["with_state"] == sorted(trainable)  # AdamW skips a parameter without a gradient
        # FSDP2 reduce-scatters each gradient padded along dim 0 to a multiple of the world size (float32 here).
        world = got["world"]
        padded = sum(-(-p.size(0) // world) * world * p[0].numel() * 4 for p in trainable.values())
        every = sum(-(-p.size(0) // world) * world * p[0].numel() * 4 for p in net.parameters())
        print(f"{name}: reduce-scattered per step {got['reduce_scattered']} bytes; trainable {padded}, all {every}")
        assert got["reduce_scattered"] == [padded] * 2
