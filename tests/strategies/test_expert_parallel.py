"""Expert parallelism (ep, fsdp+ep) on mixture-of-experts models built from their configs (tests/zoo.py).

Each cell trains 5 SGD steps on real processes and must equal serial's weights within 1e-5 with no
token dropped. Beside that, each expert weight's change over the 5 steps must equal serial's within
0.1% of it: a wrong gradient scale on the experts (1 instead of 1 / ep) moves them 2 to 4 times as far,
which the absolute bound alone would see only as a few 1e-5. What save_model wrote must load strictly,
and the memory report must hold each rank's share of the experts: 1 / ep of them under ep, 1 / dp under
fsdp+ep (FSDP2 shards each rank's experts further over dp / ep).
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

from helpers import require_module
from torchfleet import launch
from torchfleet.errors import UsageError
from torchfleet.strategies.dims import ParallelDims

require_module("transformers", "transformers (the test extra) builds the MoE models from configs")

from zoo import ZOO, train_zoo, zoo_matrix  # noqa: E402 (after the skip: zoo imports transformers lazily)

MODELS = ["hf-mixtral", "hf-qwen2-moe"]
IDLE = "hf-mixtral-idle-expert"  # no token ever reaches its expert 3: on 4 processes, rank 3 gets none
TWO = [(s, m) for s in ("ep", "fsdp+ep") for m in MODELS]
# With the router's load-balancing loss on (its token counts made global, strategies/moe_balance.py) as well.
FOUR = [*TWO, ("ep", IDLE), ("fsdp+ep", "hf-mixtral-aux")]


@functools.lru_cache(maxsize=None)
def _serial(name: str) -> dict:
    return train_zoo("serial", name)["weights"]


@pytest.fixture(scope="module")
def cells(tmp_path_factory) -> dict:
    """(processes, strategy, model) -> (result, saved file): one launch of 2 processes, one of 4."""
    out = tmp_path_factory.mktemp("ep")
    found = {}
    for nprocs, grid in ((2, TWO), (4, FOUR)):
        jobs = [(s, m, {"save_to": str(out / f"{nprocs}-{s}-{m}.pt"), "memory": True}) for s, m in grid]
        results = launch(zoo_matrix, nprocs=nprocs, args=(jobs,))
        for (s, m, options), got in zip(jobs, results[0], strict=True):
            found[nprocs, s, m] = (got, options["save_to"])
    return found


def _experts(name: str) -> dict[str, torch.Tensor]:
    """The model's initial expert weights (3-D stacks), by name."""
    torch.manual_seed(0)
    return {k: v for k, v in ZOO[name].build().state_dict().items() if k.endswith(("gate_up_proj", "down_proj"))}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nprocs, strategy, model", [(2, s, m) for s, m in TWO] + [(4, s, m) for s, m in FOUR])
def test_each_cell_equals_serial_and_moves_the_experts_as_serial_does(cells, nprocs, strategy, model):
    got, saved = cells[nprocs, strategy, model]
    assert "refused" not in got, got
    want = _serial(model)
    assert list(got["weights"]) == list(want)
    diff = max((want[k] - got["weights"][k]).abs().max().item() for k in want)
    assert diff < 1e-5, f"{strategy} on {nprocs} processes, {model}: max weight difference {diff:.3g}"
    start = _experts(model)
    assert start, f"{model} has no stacked expert weights"
    for key, before in start.items():
        serial_step, step = want[key] - before, got["weights"][key] - before
        off = (step - serial_step).abs().max().item() / serial_step.abs().max().item()
        assert off < 1e-3, f"{key}: its change is {off:.2%} off serial's"
    fresh = ZOO[model].build()
    fresh.load_state_dict(torch.load(saved, weights_only=True), strict=True)
    assert any("splits the 4 experts of 4 layers" in note for note in got["notes"]), got["notes"]


@pytest.mark.timeout(600)
def test_each_rank_holds_its_share_of_the_experts(cells):
    full = sum(v.numel() * 4 for v in _experts("hf-mixtral").values())
    for (nprocs, strategy, model), (got, _) in cells.items():
        if model != "hf-mixtral":
            continue
        ep = nprocs if strategy == "ep" else 2
        share = full // (ep if strategy == "ep" else nprocs)
        for rank, held in got["memory"].items():
            assert held["of which experts"] == share, f"{strategy} on {nprocs}: {rank} holds {held}"


@pytest.mark.timeout(600)
def test_a_rank_whose_experts_get_no_token_still_trains_with_the_others(cells):
    got, _ = cells[4, "ep", IDLE]
    torch.manual_seed(0)
    idle = ZOO[IDLE].build()
    start = {k: v for k, v in idle.state_dict().items()}
    for key in _experts(IDLE):  # expert 3 (rank 3's only one) did not move, under serial or ep
        assert torch.equal(got["weights"][key][3], start[key][3])
        assert torch.equal(_serial(IDLE)[key][3], start[key][3])


def test_the_tokens_per_expert_are_counted_before_ep_sends_them():
    from torchfleet.strategies.expert_load import ExpertLoad

    torch.manual_seed(0)
    net = ZOO[IDLE].build()
    load = ExpertLoad(net)
    inputs, _ = ZOO[IDLE].batch(8, 0)
    net(**inputs)
    shares = load.shares(torch.device("cpu"))
    tokens = inputs["input_ids"].numel()
    assert int(load.counts.sum()) == tokens * 2 * 4  # 2 experts per token, 4 layers
    assert shares[3] == 0.0 and abs(sum(shares) - 1) < 1e-12


@pytest.mark.parametrize(
    "preset, world, given, says",
    [
        ("ep", 4, {"ep": 2}, "ep splits the experts over every process (--ep 4)"),
        ("fsdp+ep", 4, {"ep": 3}, "--ep 3 does not divide the 4 data-parallel processes"),
        ("fsdp+ep", 4, {"pp": 2}, "expert parallelism beside pipeline stages is not supported yet"),
        ("fsdp+ep", 8, {"dp_replicate": 2}, "beside both replicas and shards"),
    ],
)
def test_degrees_ep_cannot_take_are_one_sentence(preset, world, given, says):
    with pytest.raises(UsageError, match=re.escape(says)):
        ParallelDims.from_preset(preset, world, **given)


def test_ep_borrows_data_parallel_ranks_and_names_its_layout():
    ep = ParallelDims.from_preset("ep", 4)
    assert (ep.dp_replicate, ep.ep, ep.world_size, ep.name) == (4, 4, 4, "ep")
    fsdp_ep = ParallelDims.from_preset("fsdp+ep", 8, ep=4)
    assert (fsdp_ep.dp_shard, fsdp_ep.ep, fsdp_ep.name) == (8, 4, "fsdp+ep")
    assert [fsdp_ep.coords(r)["ep"] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # neighbours share a group
    assert ParallelDims.from_preset("fsdp+ep", 2).ep == 2


@pytest.mark.timeout(300)
def test_train_summarises_the_tokens_per_expert_and_each_ranks_experts(tmp_path):
    from helpers import torchfleet
    from torchfleet.train.models import build_model

    out = tmp_path / "run.json"
    args = ("train", "--model", "gpt-moe", "--strategy", "fsdp+ep", "-n", "4", "--max-steps", "3")
    result = torchfleet(*args, "--epochs", "1", "--json-out", str(out), timeout=240)
    assert result.returncode == 0, result.stderr
    assert "tokens per expert" in result.stdout, result.stdout
    got = json.loads(out.read_text())
    assert got["strategy"] == "fsdp+ep" and len(got["expert_load"]) == 8  # gpt-moe's 8 experts
    assert abs(sum(got["expert_load"]) - 1) < 1e-9 and min(got["expert_load"]) > 0
    torch.manual_seed(0)
    net = build_model("gpt-moe", (64,), num_classes=10, gpt_preset="tiny")
    experts = sum(p.numel() * 4 for n, p in net.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    for rank, held in got["memory_per_rank"].items():  # split over ep(2), then sharded over dp_mod_ep(2)
        assert held["of which experts"] == experts // 4, (rank, held)


def test_an_ep_that_does_not_divide_the_experts_is_one_sentence():
    from torchfleet.strategies.expert_parallel import check_experts

    torch.manual_seed(0)
    net = ZOO["hf-mixtral"].build()
    assert len(check_experts(net, 2)) == 4  # one experts' module a layer
    assert [n for n, _ in check_experts(net, 2, ("MixtralExperts",))] == [n for n, _ in check_experts(net, 2)]
    with pytest.raises(
        UsageError, match=re.escape("--ep 3 does not divide the 4 experts of model.layers.0.mlp.experts")
    ):
        check_experts(net, 3)
    with pytest.raises(UsageError, match="has no experts to split"):
        check_experts(ZOO["hf-llama"].build(), 2)
    with pytest.raises(UsageError, match="no module of the classes NoSuchExperts"):
        check_experts(net, 2, ("NoSuchExperts",))
