"""fsdp, pipeline and ddp+pipeline compute what serial computes, and save, resume and report.

One launch per process count runs every check of that count: the
equivalence cases, a checkpoint round trip, the evaluation count and the
memory report, so the suite pays for process start-up twice, not per check.
"""

import json

import pytest
import torch
from torch import nn

from helpers import torchfleet
from torchfleet import launch
from torchfleet.errors import UsageError
from torchfleet.fleet import Fleet
from torchfleet.strategies.dims import ParallelDims
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategies.parallelize import split_balanced
from torchfleet.strategies.pipeline.strategy import Pipeline
from torchfleet.testing.equivalence import default_microbatches_job, full_weights, train_k_steps
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import build_model, build_optimizer

MLP = {"model": "mlp", "optimizer": "sgd"}
CNN = {"model": "cnn", "optimizer": "adamw", "lr": 1e-3}
# bf16 with SGD: AdamW's normalised steps would hide wrong gradients inside a loose tolerance.
BF16 = {"optimizer": "sgd", "lr": 0.05, "precision": "bf16"}
STEPS = 3


def _resume_and_evaluate(strategy: str, path: str, **options) -> dict:
    """Save after 2 steps, train 2 more, load, train the same 2 again: both must agree."""
    fleet = Fleet(strategy=strategy, **options)
    torch.manual_seed(0)
    net = build_model("mlp", (1, 8, 8), 10)
    fleet.setup(net, build_optimizer("adamw", net.parameters(), 1e-3))
    batches = list(fleet.dataloader(synthetic(32 * 4, seed=1), 32, seed=1))
    loss_fn = nn.CrossEntropyLoss()
    losses = [fleet.all_reduce(fleet.train_step(x, y, loss_fn)).item() for x, y in batches[:2]]
    fleet.save(path, step=2)
    losses += [fleet.all_reduce(fleet.train_step(x, y, loss_fn)).item() for x, y in batches[2:]]
    straight = full_weights(fleet)
    memory = fleet.strategy.memory_report()
    extra = fleet.load(path)
    for x, y in batches[2:]:
        fleet.train_step(x, y, loss_fn)
    resumed = full_weights(fleet)
    # Evaluation: each validation sample counted once over all ranks. The summed loss pairs each
    # output with its own sample's target: this data is mostly one class, so the count of right
    # answers barely moves when outputs land on the wrong rows, and the loss does.
    val = synthetic(103, seed=1, split="val")
    correct = total = val_loss = 0.0
    for x, y in fleet.eval_dataloader(val, batch_size=40):
        out = fleet.predict(x)
        if out is not None:
            out = out.float().cpu()
            correct += (out.argmax(1) == y).sum().item()
            total += len(y)
            val_loss += nn.functional.cross_entropy(out, y, reduction="sum").item()
    *counts, val_loss = fleet.all_reduce(torch.tensor([correct, total, val_loss]), op="sum").tolist()
    bad_split = None
    try:  # 30 samples do not split into the pipeline's micro-batches
        if strategy not in ("fsdp", "serial"):
            fleet.train_step(batches[0][0][:30], batches[0][1][:30], loss_fn)
    except UsageError as exc:
        bad_split = str(exc)
    return {
        "straight": straight,
        "resumed": resumed,
        "step": extra["step"],
        "memory": memory,
        "losses": losses,
        "counts": counts,
        "val_loss": val_loss,
        "bad_split": bad_split,
    }


def _load_and_continue(strategy: str, paths: list[str], options: dict) -> list[tuple]:
    """For each checkpoint: (weights just loaded, weights after the 2 steps that followed the save)."""
    results = []
    for path in paths:
        fleet = Fleet(strategy=strategy, **options)
        torch.manual_seed(5)  # other initial weights: only the checkpoint can make them right
        net = build_model("mlp", (1, 8, 8), 10)
        fleet.setup(net, build_optimizer("adamw", net.parameters(), 1e-3))
        batches = list(fleet.dataloader(synthetic(32 * 4, seed=1), 32, seed=1))
        assert fleet.load(path)["step"] == 2
        loaded = full_weights(fleet)
        for x, y in batches[2:]:
            fleet.train_step(x, y, nn.CrossEntropyLoss())
        results.append((loaded, full_weights(fleet)))
    fleet.close()
    return results


def _job(cases: list[tuple[str, dict]], resume: list[tuple[str, dict]], directory: str) -> dict:
    weights = [train_k_steps(strategy, steps=STEPS, **case) for strategy, case in cases]
    checks = [_resume_and_evaluate(s, f"{directory}/{i}.pt", **opts) for i, (s, opts) in enumerate(resume)]
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return {"weights": weights, "resume": checks}


def _serial(case: dict) -> torch.Tensor:
    plain = {k: v for k, v in case.items() if k not in ("schedule", "microbatches", "pp")}
    return train_k_steps("serial", steps=STEPS, **plain)


def _check_equivalence(cases, weights):
    for (strategy, case), got in zip(cases, weights, strict=True):
        want = _serial(case)
        tolerance = 1e-5 if case.get("precision", "fp32") == "fp32" else 1e-3
        diff = (got - want).abs().max().item()
        assert diff < tolerance, f"{strategy} {case}: max weight difference {diff:.3g}"
        untouched = train_k_steps("serial", steps=1, model=case["model"], optimizer=case["optimizer"], lr=1e-12)
        assert (got - untouched).abs().max().item() > 1e-3  # training moved the weights


def _check_resume(check, world: int, replicas: int, tmp_path, **options):
    serial = _resume_and_evaluate("serial", str(tmp_path / "serial.pt"), **options)
    assert (check["straight"] - serial["straight"]).abs().max().item() < 1e-5
    assert check["losses"] == pytest.approx(serial["losses"], abs=1e-5)  # the ranks' mean is the batch's
    assert check["step"] == 2
    assert (check["straight"] - check["resumed"]).abs().max().item() == 0  # bit for bit
    # Each of the 103 validation samples counted once and predicted as serial predicts it (the
    # same weights): the same number right and the same loss, sample by sample.
    assert serial["counts"][1] == 103
    assert check["counts"] == serial["counts"], f"[right, counted] {check['counts']}, serial's {serial['counts']}"
    assert check["val_loss"] == pytest.approx(serial["val_loss"], rel=1e-5), "validation loss"
    memory = check["memory"]
    assert sorted(memory) == [f"rank {r}" for r in range(world)]
    # Replicas (the outer dimension of the mesh) hold the same as the ranks they copy.
    group = world // replicas
    for r in range(group, world):
        assert memory[f"rank {r}"] == memory[f"rank {r % group}"], f"rank {r} is a replica of rank {r % group}"
    return memory


TWO = [
    ("fsdp", MLP),
    ("fsdp", CNN),
    ("fsdp", dict(MLP, grad_accum=2)),
    ("fsdp", dict(CNN, **BF16)),
    ("pipeline", dict(MLP, schedule="gpipe")),
    ("pipeline", dict(CNN, schedule="gpipe")),
    ("pipeline", dict(MLP, schedule="1f1b")),
    ("pipeline", dict(CNN, schedule="1f1b", microbatches=2)),
    ("pipeline", dict(MLP, schedule="1f1b", grad_accum=2, microbatches=2)),
    ("pipeline", dict(CNN, schedule="gpipe", **BF16)),
    # The loader built before setup reads the same share as one built after.
    ("fsdp", dict(MLP, loader_first=True)),
    ("pipeline", dict(MLP, schedule="gpipe", loader_first=True)),
]


@pytest.mark.timeout(300)
def test_fsdp_and_pipeline_two_processes(tmp_path):
    resume = [("fsdp", {"grad_accum": 2}), ("pipeline", {"schedule": "1f1b", "microbatches": 4})]
    rank0, rank1 = launch(_job, nprocs=2, args=(TWO, resume, str(tmp_path)))
    assert rank1["weights"] == [None] * len(TWO)  # the full weights live on rank 0 only
    _check_equivalence(TWO, rank0["weights"])

    fsdp, pipe = rank0["resume"]
    mlp_bytes = sum(p.numel() * 4 for p in build_model("mlp").parameters())
    memory = _check_resume(fsdp, world=2, replicas=1, tmp_path=tmp_path, grad_accum=2)
    for held in memory.values():  # each rank holds half of params, grads and AdamW's two moments
        assert held["params"] == held["grads"] == mlp_bytes // 2
        assert 2 * mlp_bytes // 2 <= held["optimizer"] < 2 * mlp_bytes // 2 + 64
    memory = _check_resume(pipe, world=2, replicas=1, tmp_path=tmp_path)
    assert memory["rank 0"]["params"] + memory["rank 1"]["params"] == mlp_bytes
    assert "batch of 30 does not split into 1 accumulation steps x 4 micro-batches" in pipe["bad_split"]


FOUR = [
    ("ddp+pipeline", dict(MLP, pp=2)),
    ("ddp+pipeline", dict(CNN, pp=2, schedule="gpipe")),
    ("ddp+pipeline", dict(MLP, pp=2, loader_first=True)),
    ("fsdp+pipeline", MLP),
    ("fsdp+pipeline", dict(CNN, schedule="gpipe", loader_first=True)),
    ("hsdp", MLP),
    ("hsdp", dict(CNN, grad_accum=2, loader_first=True)),
]
# Each 2 x 2: the checkpoint is saved after 2 steps, with accumulation on.
RESUME_FOUR = [
    ("ddp+pipeline", {"pp": 2, "microbatches": 2, "grad_accum": 2}),
    ("fsdp+pipeline", {"microbatches": 2, "grad_accum": 2}),
    ("hsdp", {"grad_accum": 2}),
]


@pytest.mark.timeout(400)
def test_two_dimensional_presets_four_processes(tmp_path):
    results = launch(_job, nprocs=4, args=(FOUR, RESUME_FOUR, str(tmp_path)))
    _check_equivalence(FOUR, results[0]["weights"])
    assert all(r["weights"] == [None] * len(FOUR) for r in results[1:])
    ddp_pp, fsdp_pp, hsdp = results[0]["resume"]
    _check_resume(ddp_pp, world=4, replicas=2, tmp_path=tmp_path, grad_accum=2)
    memory = _check_resume(fsdp_pp, world=4, replicas=1, tmp_path=tmp_path, grad_accum=2)
    mlp_bytes = sum(p.numel() * 4 for p in build_model("mlp").parameters())
    assert sum(m["params"] for m in memory.values()) == mlp_bytes  # 2 stages x 2 shards: no copy
    memory = _check_resume(hsdp, world=4, replicas=2, tmp_path=tmp_path, grad_accum=2)
    assert memory["rank 0"]["params"] + memory["rank 1"]["params"] == mlp_bytes  # of 2 shards

    # Each DCP checkpoint (2 x 2) loads into 1 process and into a 2-stage pipeline:
    # the same weights, and training goes on as it did in the 4 processes.
    saved = [str(tmp_path / f"{i}.pt") for i in range(len(RESUME_FOUR))]
    for path in saved:
        assert json.loads((tmp_path / path / "manifest.json").read_text())["layout"] == "sharded"
    serial = _load_and_continue("serial", saved, {"grad_accum": 2})
    pipe = launch(_load_and_continue, nprocs=2, args=("pipeline", saved, {"grad_accum": 2, "microbatches": 2}))[0]
    step2 = torch.load(tmp_path / "serial.pt" / "state.pt", weights_only=True)["model"]
    step2 = torch.cat([t.flatten() for t in step2.values()])
    for check, (serial_loaded, serial_after), (pipe_loaded, pipe_after) in zip(
        results[0]["resume"], serial, pipe, strict=True
    ):
        assert torch.equal(serial_loaded, pipe_loaded)
        assert (serial_loaded - step2).abs().max().item() < 1e-5
        for after in (serial_after, pipe_after):  # AdamW's moments came back too: a fresh AdamW lands elsewhere
            assert (after - check["resumed"]).abs().max().item() < 1e-5


def test_stages_balanced_by_parameters():
    assert split_balanced(build_model("mlp"), 2) == [(0, 3), (3, 6)]
    assert split_balanced(build_model("cnn"), 2) == [(0, 6), (6, 9)]
    assert split_balanced(build_model("cnn"), 4) == [(0, 2), (2, 6), (6, 8), (8, 9)]
    with pytest.raises(UsageError, match="3 layers with parameters, too few for 4 stages"):
        split_balanced(build_model("mlp"), 4)
    with pytest.raises(UsageError, match="nn.Sequential"):
        split_balanced(nn.Linear(2, 2), 2)


def test_mesh_arithmetic_is_checked():
    def degrees(preset, world, **given):
        d = ParallelDims.from_preset(preset, world, **given)
        return d.dp_replicate, d.dp_shard, d.pp

    assert degrees("ddp", 4) == (4, 1, 1) and degrees("fsdp", 4) == (1, 4, 1) and degrees("pipeline", 3) == (1, 1, 3)
    assert degrees("ddp+pipeline", 4) == (2, 1, 2) and degrees("ddp+pipeline", 6, pp=3) == (2, 1, 3)
    assert degrees("fsdp+pipeline", 4) == (1, 2, 2) and degrees("hsdp", 4) == (2, 2, 1)
    assert degrees("hsdp", 8, dp_replicate=4) == (4, 2, 1)
    assert ParallelDims.from_preset("hsdp", 8, nodes=2).dp_replicate == 2  # one replica per machine
    assert degrees("ddp", 4, pp=2) == (2, 1, 2)  # a degree flag turns a preset into another
    with pytest.raises(UsageError, match=r"dp_replicate\(1\) \* dp_shard\(1\) \* pp\(3\) != 4 processes"):
        ParallelDims.from_preset("ddp+pipeline", 4, pp=3)
    with pytest.raises(UsageError, match=r"dp_replicate\(2\) \* dp_shard\(3\) \* pp\(2\) != 8 processes"):
        ParallelDims(2, 3, 2, world_size=8)
    with pytest.raises(UsageError, match="--pp 0 must be at least 1"):
        ParallelDims.from_preset("pipeline", 4, pp=0)
    with pytest.raises(UsageError, match="unknown schedule 'zigzag'"):
        Pipeline(None, StrategyOptions.of({"schedule": "zigzag"}))  # type: ignore[arg-type]


def test_names_and_layout_follow_the_degrees():
    names = {
        (1, 4, 1): "fsdp",
        (4, 1, 1): "ddp",
        (2, 2, 1): "hsdp",
        (1, 1, 4): "pipeline",
        (2, 1, 2): "ddp+pipeline",
        (1, 2, 2): "fsdp+pipeline",
        (1, 1, 1): "ddp",
    }
    for (r, s, p), name in names.items():
        assert ParallelDims(r, s, p, world_size=r * s * p).name == name
    # Row-major ("dp_replicate", "dp_shard", "pp"): a pipeline's stages are neighbouring ranks.
    dims = ParallelDims(2, 1, 2, world_size=4)
    assert [dims.coords(rank)["pp"] for rank in range(4)] == [0, 1, 0, 1]
    assert [dims.dp_rank(rank) for rank in range(4)] == [0, 0, 1, 1]
    hsdp = ParallelDims(2, 2, 1, world_size=4)
    assert [(hsdp.coords(r)["dp_replicate"], hsdp.coords(r)["dp_shard"]) for r in range(4)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]


@pytest.mark.timeout(300)
def test_pipeline_train_command_reports_memory_and_bubble(tmp_path):
    out = tmp_path / "result.json"
    result = torchfleet(
        "train",
        "--strategy",
        "pipeline",
        "-n",
        "2",
        "--model",
        "cnn",
        "--epochs",
        "2",
        "--schedule",
        "gpipe",
        "--microbatches",
        "4",
        "--json-out",
        str(out),
        "--no-progress",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert figures["strategy"] == "pipeline" and figures["val_accuracy"] > 0.9
    cnn_bytes = sum(p.numel() * 4 for p in build_model("cnn").parameters())
    memory = figures["memory_per_rank"]
    assert memory["rank 0"]["params"] + memory["rank 1"]["params"] == cnn_bytes
    pipe = figures["pipeline"]
    assert pipe["bubble_formula"] == 0.2 and pipe["layers_per_stage"] == ["0-5", "6-8"]
    assert len(pipe["bubble_measured"]) == 2 and all(0 <= f < 1 for f in pipe["bubble_measured"])
    assert "bubble measured" in result.stdout and "memory rank 1" in result.stdout


@pytest.mark.timeout(240)
def test_a_two_stage_checkpoint_resumes_as_three_stages_from_the_cli(tmp_path):
    """64 samples per batch: 3 stages take 4 micro-batches by default (6 would not divide it)."""
    common = [
        "train",
        "--strategy",
        "pipeline",
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--epochs",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--checkpoint-every",
        "5",
        "--no-progress",
    ]
    first = torchfleet(*common, "-n", "2", "--max-steps", "10")
    assert first.returncode == 0, first.stderr
    second = torchfleet(*common, "-n", "3", "--max-steps", "15", "--resume", "--json-out", str(tmp_path / "r.json"))
    assert second.returncode == 0, second.stderr
    assert f"resumed from {tmp_path / 'ck' / 'step-00000010'} at step 10" in second.stdout + second.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["steps"] == 15 and result["world_size"] == 3
    assert result["pipeline"]["microbatches"] == 4 and result["pipeline"]["stages"] == 3
    assert 0.2 < result["val_accuracy"] <= 1  # 10 classes: trained, not chance
    manifest = json.loads((tmp_path / "ck" / "step-00000015" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["layout"]) == (3, "sharded")


@pytest.mark.timeout(120)
def test_default_microbatches_stay_at_16_samples_for_pointwise_convolutions_on_one_thread():
    # ATen runs 1x1 convolutions natively, 2.3x slower a sample for ResNet-50, below 16
    # samples on a one-thread CPU process; 3x3 ones always go to oneDNN.
    threads, chosen = launch(default_microbatches_job, nprocs=2)[0]
    assert chosen[3] == 4  # 2 x stages, the usual default
    assert chosen[1] == (2 if threads == 1 else 4), f"{threads} threads per process"
