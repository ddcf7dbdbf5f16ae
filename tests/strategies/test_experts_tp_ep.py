"""Experts under tp and ep together (``--strategy ep --tp 2``, ``fsdp+ep --tp 2``) on mixture-of-experts models
built from their configs (tests/zoo.py): 4 processes, tp 2 by ep 2.

Each rank of an ep group keeps half the experts, each of them split over its tp group as the model's
plan splits it (Qwen3-MoE's and Mixtral's ``moe_tp_experts``); attention stays tp-split and replicated
(ep) or sharded (fsdp+ep) over the data-parallel ranks. A few AdamW steps must end at serial's weights
within 1e-5, the tokens per expert counted over every rank must be serial's shares, and each rank must
hold a quarter of the experts.

Two optimizers. SGD, 5 steps as the zoo's cells (tests/strategies/test_zoo.py), within the zoo's 1e-5 of serial. AdamW,
whose update divides each gradient by its own running size, so an entry whose gradient is near float32's
rounding takes a full step either way: there ep alone on 4 processes already ended 5.1e-5 from serial
(Qwen3-MoE, 4 steps at lr 1e-3; fsdp+tp 2.6e-5), so under AdamW at most 0.1% of the entries may be more than 1e-5
from serial, and none by more than the learning rate times the steps. Measured on 2 CPU cores with
torch 2.14.1: SGD 7.5e-9 (gpt-moe 5.6e-9); AdamW 5.5e-5 on Qwen3-MoE (ep alone 5.1e-5), 7.3e-6 on Mixtral;
with transformers 5.24 (30 Nov) Qwen3-MoE's AdamW cells read 1.2e-4 (ep alone 4.3e-5).
On torch 2.11 tp's split of these experts is refused in one sentence, as under tp alone.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

from helpers import require_module, whole_grids
from torchfleet import launch
from torchfleet.errors import UsageError
from torchfleet.strategies.dims import ParallelDims
from torchfleet.versions import release

require_module("transformers", "transformers (the test extra) builds the MoE models from configs")

from zoo import ZOO  # noqa: E402 (after the skip: zoo imports transformers lazily)

MODELS = ["hf-qwen3-moe", "hf-mixtral"]
# (strategy, model, optimizer, its tp degree): tp by ep under both optimizers, and ep alone as AdamW's yardstick.
CELLS = [(s, m, "sgd", 2) for s in ("ep", "fsdp+ep") for m in MODELS]
CELLS += [(s, m, "adamw", tp) for s, tp in (("ep", 2), ("fsdp+ep", 2), ("ep", 1)) for m in MODELS]
# `make test` (CI) trains each model under one of the two layouts with SGD; the others are the `slow` tier's.
SAMPLE = {("ep", "hf-mixtral", "sgd", 2), ("fsdp+ep", "hf-qwen3-moe", "sgd", 2)}
STEPS = {"sgd": 5, "adamw": 4}
LR = {"sgd": 1e-2, "adamw": 1e-3}
# Before 2.14, DTensor cannot gather the strided shard tp splits an experts' packed gate and up halves into.
STRIDED_REFUSAL = "as a strided shard, which torch 2.1"


def train_job(strategy: str, name: str, optimizer: str, **fleet_options) -> dict | None:
    """Zoo model `name` after STEPS[optimizer] steps of batch 8 under `strategy`: its weights, notes, tokens per
    expert and memory on the main rank, {"refused": the sentence} where setup refuses, None elsewhere."""
    from torchfleet import Fleet
    from torchfleet.verify.train import rows

    entry = ZOO[name]
    fleet = Fleet(strategy=strategy, **fleet_options)
    torch.manual_seed(0)
    net = entry.build()
    batches = [entry.batch(8, seed) for seed in range(STEPS[optimizer])]
    share = fleet.strategy.data_coords()
    kind = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    try:
        fleet.setup(net, kind(net.parameters(), lr=LR[optimizer]), example_inputs=rows(batches[0], *share)[0])
    except UsageError as error:
        return {"refused": str(error)} if fleet.is_main else None
    for one in batches:
        fleet.train_step(*rows(one, *share), entry.loss)
    state, _ = fleet.strategy.state_dicts()
    device = fleet.strategy.runtime.device
    found = {
        "weights": {k: v.detach().float().cpu().clone() for k, v in state.items()},
        "notes": list(fleet.notes),
        "shares": fleet.expert_load.shares(device) if fleet.expert_load else None,
        "memory": fleet.strategy.memory_report() if fleet.strategy.distributed else None,
    }
    return found if fleet.is_main else None


# The built-in gpt-moe, whose plan leaves the experts whole: each rank of a tp group holds its ep share whole.
# (strategy, max_grad_norm): clipped too, at a norm that moved serial's weights by 1e-2, with experts and
# attention split over different meshes.
GPT_MOE = [("ep", None), ("fsdp+ep", None), ("ep", 0.05)]


def round_trip_job(directory: str) -> dict | None:
    """Mixtral under ep --tp 2: a whole checkpoint saved after 2 AdamW steps, 2 more steps, the checkpoint loaded back.
    On the main rank the weights at the save and after loading, or {"refused": the sentence}."""
    from torchfleet import Fleet
    from torchfleet.verify.train import rows

    entry = ZOO["hf-mixtral"]
    fleet = Fleet(strategy="ep", tp=2)
    torch.manual_seed(0)
    net = entry.build()
    share = fleet.strategy.data_coords()
    try:
        fleet.setup(
            net, torch.optim.AdamW(net.parameters(), lr=1e-3), example_inputs=rows(entry.batch(8, 0), *share)[0]
        )
    except UsageError as error:
        return {"refused": str(error)} if fleet.is_main else None
    for seed in range(4):
        if seed == 2:
            # Whole, and sharded through torch.distributed.checkpoint, which writes the strided shard of the
            # experts' gate and up halves replicated (checkpoint/strided.py).
            fleet.save(f"{directory}/step-2", sharded=False)
            fleet.save(f"{directory}/step-2-sharded", sharded=True)
            saved, _ = fleet.strategy.state_dicts()
        fleet.train_step(*rows(entry.batch(8, seed), *share), entry.loss)
    fleet.load(f"{directory}/step-2")
    loaded, _ = fleet.strategy.state_dicts()
    fleet.train_step(*rows(entry.batch(8, 9), *share), entry.loss)
    fleet.load(f"{directory}/step-2-sharded")
    loaded_sharded, _ = fleet.strategy.state_dicts()
    return {"saved": saved, "loaded": loaded, "loaded_sharded": loaded_sharded} if fleet.is_main else None


def cells_job(cells: list[tuple[str, str, str, int]], directory: str) -> list:
    from torchfleet.testing.real_models import train_real_model

    results = [train_job(strategy, name, optimizer, tp=tp) for strategy, name, optimizer, tp in cells]
    results += [
        train_real_model(strategy, model="gpt-moe", fleet_options={"max_grad_norm": norm}, tp=2)
        for strategy, norm in GPT_MOE
    ]
    results.append(round_trip_job(directory))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return results


@functools.lru_cache(maxsize=None)
def _serial(name: str, optimizer: str) -> dict:
    return train_job("serial", name, optimizer)


def _far(want: dict, got: dict, tolerance: float = 1e-5) -> float:
    """The share of weight entries more than `tolerance` from serial's."""
    over = sum(int(((want["weights"][k] - got["weights"][k]).abs() > tolerance).sum()) for k in want["weights"])
    return over / sum(v.numel() for v in want["weights"].values())


def _diff(want: dict, got: dict) -> float:
    assert list(got["weights"]) == list(want["weights"])
    return max((want["weights"][k] - got["weights"][k]).abs().max().item() for k in want["weights"])


@pytest.fixture(scope="module")
def cells(tmp_path_factory, request) -> dict:
    """Every cell's result on the main rank, and the checkpoint's round trip: one launch of 4 processes. `make test`
    (CI) trains SAMPLE alone: AdamW's cells (the `slow` tier) took most of the file's 236 CPU-seconds, and with
    four SGD cells this launch took 131 of the file's 150 in CI on 30 Nov."""
    chosen = CELLS if whole_grids(request.config) else [c for c in CELLS if c in SAMPLE]
    got = launch(cells_job, nprocs=4, args=(chosen, str(tmp_path_factory.mktemp("tp-ep"))))
    assert all(r is None for rank in got[1:] for r in rank)  # only the main rank reports
    return dict(zip([*chosen, *GPT_MOE, "round trip"], got[0], strict=True))


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "strategy, model, optimizer",
    [pytest.param(*c[:3], marks=() if c in SAMPLE else pytest.mark.slow) for c in CELLS if c[3] == 2],
)
def test_tp_by_ep_trains_as_serial_and_counts_the_tokens_per_expert_as_serial(cells, strategy, model, optimizer):
    got = cells[strategy, model, optimizer, 2]
    if "refused" in got:
        sentence = got["refused"]
        assert "\n" not in sentence and release() < (2, 14) and STRIDED_REFUSAL in sentence, sentence
        return
    want = _serial(model, optimizer)
    diff = _diff(want, got)
    print(f"{model} under {strategy} --tp 2, {optimizer}: max weight difference {diff:.3g} from serial")
    if optimizer == "sgd":
        assert diff < 1e-5, f"{strategy} --tp 2 on {model}: max weight difference {diff:.3g} from serial"
    else:
        alone = _diff(want, cells["ep", model, optimizer, 1])
        far, alone_far = _far(want, got), _far(want, cells["ep", model, optimizer, 1])
        print(
            f"{model} under ep alone, {optimizer}: {alone:.3g}; entries over 1e-5: {far:.2%}, ep alone {alone_far:.2%}"
        )
        # An optimizer state split or summed wrong moves most entries by about the learning rate; AdamW's rounding
        # moves a few near-zero gradients' entries by up to a full step (Qwen3-MoE on transformers 5.24: 1.2e-4
        # under tp by ep, 4.3e-5 under ep alone). So: within the zoo's 1e-5 but for at most 0.1% of the entries,
        # and none by more than the steps' sum (LR x STEPS).
        assert far <= 1e-3, f"{strategy} --tp 2 on {model}: {far:.2%} of entries over 1e-5 from serial"
        assert diff < LR[optimizer] * STEPS[optimizer], f"{strategy} --tp 2 on {model}: {diff:.3g} from serial"
    name = f"{strategy}+tp"
    assert any(n.startswith(f"{name} splits the 4 experts of") for n in got["notes"]), got["notes"]
    assert got["shares"] == pytest.approx(want["shares"], abs=1e-12) and len(got["shares"]) == 4
    torch.manual_seed(0)
    experts = ZOO[model].build().state_dict()
    full = sum(v.numel() * 4 for k, v in experts.items() if k.endswith(("gate_up_proj", "down_proj")))
    for rank, held in got["memory"].items():  # half the experts (ep), each half of it (tp)
        assert held["of which experts"] == full // 4, (rank, held)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy, norm", GPT_MOE)
def test_experts_a_plan_leaves_whole_train_as_serial_under_tp_by_ep(cells, strategy, norm):
    from torchfleet.testing.real_models import train_real_model

    want = train_real_model("serial", model="gpt-moe", fleet_options={"max_grad_norm": norm})
    got = cells[strategy, norm]
    assert set(got) == set(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    print(f"gpt-moe under {strategy} --tp 2, clipped at {norm}: max weight difference {diff:.3g} from serial")
    assert diff < 1e-5, f"gpt-moe under {strategy} --tp 2, clipped at {norm}: {diff:.3g} from serial"


@pytest.mark.timeout(900)
def test_a_checkpoint_saved_under_tp_by_ep_loads_back_exactly(cells):
    got = cells["round trip"]
    if "refused" in got:
        assert release() < (2, 14) and STRIDED_REFUSAL in got["refused"], got["refused"]
        return
    saved = got["saved"]
    assert any(k.endswith("experts.gate_up_proj") for k in saved)
    for layout in ("loaded", "loaded_sharded"):
        loaded = got[layout]
        assert list(saved) == list(loaded), layout
        assert max((saved[k] - loaded[k]).abs().max().item() for k in saved) == 0.0, layout


def test_tp_beside_ep_is_spelled_with_degrees_and_named_from_them():
    ep_tp = ParallelDims.from_preset("ep", 4, tp=2)
    assert (ep_tp.dp_replicate, ep_tp.dp_shard, ep_tp.tp, ep_tp.ep, ep_tp.name) == (2, 1, 2, 2, "ep+tp")
    fsdp_ep_tp = ParallelDims.from_preset("fsdp+ep", 8, tp=2)
    assert (fsdp_ep_tp.dp_shard, fsdp_ep_tp.tp, fsdp_ep_tp.ep, fsdp_ep_tp.name) == (4, 2, 2, "fsdp+ep+tp")
    # tp's ranks neighbours, then the ep group: ranks 0 and 2 share experts 0-1's column 0
    assert [(ep_tp.coords(r)["ep"], ep_tp.coords(r)["tp"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(UsageError, match=re.escape("expert parallelism beside pipeline stages is not supported")):
        ParallelDims(dp_replicate=2, dp_shard=1, pp=2, world_size=4, ep=2)


@pytest.mark.timeout(300)
def test_train_under_ep_and_tp_sums_the_tokens_per_expert_over_every_rank(tmp_path):
    from helpers import torchfleet
    from torchfleet.train.models import build_model

    out = tmp_path / "run.json"
    args = ("train", "--model", "gpt-moe", "--strategy", "ep", "--tp", "2", "-n", "4", "--max-steps", "3")
    result = torchfleet(*args, "--epochs", "1", "--json-out", str(out), timeout=240)
    assert result.returncode == 0, result.stderr
    assert "tokens per expert" in result.stdout and "ep+tp splits the 8 experts" in result.stdout, result.stdout
    got = json.loads(out.read_text())
    assert len(got["expert_load"]) == 8 and abs(sum(got["expert_load"]) - 1) < 1e-9 and min(got["expert_load"]) > 0
    torch.manual_seed(0)
    net = build_model("gpt-moe", (64,), num_classes=10, gpt_preset="tiny")
    experts = sum(p.numel() * 4 for n, p in net.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    for rank, held in got["memory_per_rank"].items():  # gpt-moe's plan keeps experts whole: half each, by ep
        assert held["of which experts"] == experts // 2, (rank, held)


@pytest.mark.timeout(300)
def test_an_ep_that_does_not_divide_the_experts_beside_tp_is_one_sentence():
    from helpers import torchfleet

    # 6 processes by tp 2: 3 data-parallel ranks, every one of them in the ep group, for gpt-moe's 8 experts
    result = torchfleet(
        "train", "--model", "gpt-moe", "--strategy", "ep", "--tp", "2", "-n", "6", "--batch-size", "48", timeout=240
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "does not divide" in line]
    assert lines and "--ep 3 does not divide the 8 experts of" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
