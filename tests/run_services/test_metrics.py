"""train's metrics: a CSV or JSON-lines file and TensorBoard events holding the figures the loop computed."""

import csv
import json

import pytest
import torch

from helpers import require_module
from torchfleet.errors import UsageError
from torchfleet.run_services.metrics import MetricsLog
from torchfleet.train.config import TrainConfig
from torchfleet.train.loop import train

# 256 samples in batches of 32: 8 steps an epoch. lr is TrainConfig's default.
JOB = dict(model="mlp", data="synthetic", synthetic_size=256, batch_size=32, progress=False, hang_timeout=0)
LR = 2e-3
TEXT = ("kind", "host", "memory_kind", "phase", "message")  # the columns that hold words


def _train(**options) -> dict:
    return train(TrainConfig(**JOB, **options), "serial")


def _rows(path) -> list[dict]:
    if path.suffix != ".csv":
        return [json.loads(line) for line in path.read_text().splitlines()]
    with open(path, newline="") as f:  # numbers back to numbers; an empty cell is a figure the row lacks
        return [
            {k: v if k in TEXT else int(v) if k in ("step", "epoch", "rank") else float(v) for k, v in row.items() if v}
            for row in csv.DictReader(f)
        ]


def test_a_row_per_logged_step_and_per_epoch(tmp_path):
    every = _train(epochs=2, log_every=1, metrics_out=str(tmp_path / "every.jsonl"))
    sparse = _train(epochs=2, log_every=3, metrics_out=str(tmp_path / "sparse.csv"))
    assert sparse["val_accuracy"] == every["val_accuracy"]  # logging less changes nothing computed
    each = {r["step"]: r for r in _rows(tmp_path / "every.jsonl") if r["kind"] == "train"}
    assert sorted(each) == list(range(1, 17))
    rows = _rows(tmp_path / "sparse.csv")
    # Every third step, and each epoch's last step (8, 16) before its validation row.
    assert [(r["kind"], r["step"], r["epoch"]) for r in rows] == [
        ("train", 3, 1),
        ("train", 6, 1),
        ("train", 8, 1),
        ("val", 8, 1),
        ("train", 9, 2),
        ("train", 12, 2),
        ("train", 15, 2),
        ("train", 16, 2),
        ("val", 16, 2),
    ]
    previous = 0
    for row in rows:
        if row["kind"] == "train":  # the mean of the steps since the last row
            since = [each[s]["loss"] for s in range(previous + 1, row["step"] + 1)]
            assert row["loss"] == pytest.approx(sum(since) / len(since), rel=1e-12, abs=0)
            assert row["lr"] == LR and row["samples_per_s"] > 0
            previous = row["step"]
        else:
            assert set(row) == {"kind", "step", "epoch", "elapsed_s", "val_accuracy"}
    assert rows[-1]["val_accuracy"] == sparse["val_accuracy"]
    elapsed = [r["elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0


@pytest.mark.timeout(150)
def test_ddp_logs_the_whole_batchs_loss_as_serial_does(tmp_path):
    from helpers import torchfleet

    job = [
        "train",
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--synthetic-size",
        "256",
        "--batch-size",
        "32",
        "--epochs",
        "1",
        "--log-every",
        "3",
        "--no-progress",
        "--hang-timeout",
        "0",
    ]
    for strategy, n in (("ddp", "2"), ("serial", "1")):
        done = torchfleet(*job, "--strategy", strategy, "-n", n, "--metrics-out", str(tmp_path / f"{strategy}.csv"))
        assert done.returncode == 0, done.stderr
    ddp, serial = _rows(tmp_path / "ddp.csv"), _rows(tmp_path / "serial.csv")  # rank 0 wrote ddp's alone
    ranks = [r for r in ddp if r["kind"] == "rank"]  # each rank's figures at each logged step; serial has none
    assert [(r["step"], r["rank"]) for r in ranks] == [(s, k) for s in (3, 6, 8) for k in (0, 1)]
    assert all(r["step_s"] >= r["compute_s"] > 0 for r in ranks) and {r["kind"] for r in serial} == {"train", "val"}
    ddp = [r for r in ddp if r["kind"] in ("train", "val")]
    assert [(r["kind"], r["step"]) for r in ddp] == [(r["kind"], r["step"]) for r in serial]
    for a, b in zip(ddp, serial, strict=True):  # each rank's loss of its half, averaged: the batch's loss
        assert abs(a.get("loss", 0) - b.get("loss", 0)) < 1e-6 and a.get("val_accuracy") == b.get("val_accuracy")


@pytest.mark.timeout(120)
def test_gpt_rows_hold_its_validation_loss_and_perplexity(tmp_path):
    out = tmp_path / "gpt.json"  # .json is JSON lines too
    result = train(
        TrainConfig(model="gpt", max_steps=2, log_every=2, progress=False, hang_timeout=0, metrics_out=str(out)),
        "serial",
    )
    train_row, val_row = _rows(out)
    assert train_row["kind"] == "train" and train_row["step"] == 2
    assert val_row == {
        "kind": "val",
        "step": 2,
        "epoch": 1,
        "elapsed_s": val_row["elapsed_s"],
        "val_loss": result["val_loss"],
        "val_perplexity": result["val_perplexity"],
    }


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_resumed_run_continues_the_file(tmp_path, suffix):
    straight, stopped = tmp_path / f"straight{suffix}", tmp_path / f"stopped{suffix}"
    _train(epochs=2, log_every=3, metrics_out=str(straight))
    ckpt = str(tmp_path / "ckpt")
    _train(epochs=2, log_every=3, metrics_out=str(stopped), checkpoint_dir=ckpt, max_steps=8)
    _train(epochs=2, log_every=3, metrics_out=str(stopped), checkpoint_dir=ckpt, resume=True)

    def computed(path):  # what training computed; the times differ from run to run
        return [{k: v for k, v in r.items() if k not in ("samples_per_s", "elapsed_s")} for r in _rows(path)]

    assert computed(stopped) == computed(straight)  # resume is bit for bit, and so is the file
    assert stopped.read_text().count("kind") == (1 if suffix == ".csv" else 9)  # one header


def test_a_restart_drops_the_rows_it_computes_again(tmp_path):
    path = tmp_path / "m.csv"
    with MetricsLog(str(path), figures=("val_accuracy",)) as log:
        for step in (3, 6):
            log.step(step, 1, 0.5, LR, samples=32 * step)
        log.epoch(6, 1, {"val_accuracy": 0.75})  # an epoch of 6 steps
        log.step(9, 2, 0.5, LR, samples=32 * 9)
    with open(path, "a") as f:
        f.write("train,12,2,0.4")  # the row being written when the rank died
    # The group restarts from the checkpoint of step 6 (the epoch's end, before its evaluation:
    # the restarted run evaluates again) and logs step 9 again.
    with MetricsLog(str(path), figures=("val_accuracy",), start_step=6) as log:
        log.epoch(6, 1, {"val_accuracy": 0.75})
        log.step(9, 2, 0.25, LR, samples=96)
    rows = _rows(path)
    assert [(r["kind"], r["step"], r.get("loss")) for r in rows] == [
        ("train", 3, 0.5),
        ("train", 6, 0.5),
        ("val", 6, None),
        ("train", 9, 0.25),
    ]
    with pytest.raises(UsageError, match="has other columns than this run writes"):
        MetricsLog(str(path), figures=("val_loss", "val_perplexity"), start_step=6)


def test_tensorboard_holds_the_same_scalars_as_the_file(tmp_path):
    require_module("tensorboard", "the dev extra installs tensorboard; --tensorboard needs it")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _train(epochs=2, log_every=3, metrics_out=str(tmp_path / "m.csv"), tensorboard=str(tmp_path / "tb"))
    rows = _rows(tmp_path / "m.csv")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/loss", "train/lr", "train/samples_per_s", "val/accuracy"]
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731 - TensorBoard keeps float32
    for tag, kind, column in (
        ("train/loss", "train", "loss"),
        ("train/lr", "train", "lr"),
        ("train/samples_per_s", "train", "samples_per_s"),
        ("val/accuracy", "val", "val_accuracy"),
    ):
        scalars = [(e.step, e.value) for e in events.Scalars(tag)]
        assert scalars == [(r["step"], f32(r[column])) for r in rows if r["kind"] == kind], tag
    assert [e.step for e in events.Scalars("train/loss")] == [3, 6, 8, 9, 12, 15, 16]


def test_bad_metrics_options_are_one_sentence(tmp_path, monkeypatch, capsys):
    with pytest.raises(
        UsageError,
        match=r"--metrics-out 'm.txt' must end in .csv \(a table with a header\)"
        r" or .jsonl \(JSON lines; .json is read the same way\)",
    ):
        TrainConfig(metrics_out="m.txt")
    with pytest.raises(UsageError, match="--log-every 0 must be at least 1"):
        TrainConfig(log_every=0)

    from torchfleet import cli
    from torchfleet.run_services import metrics

    real = metrics.importlib.util.find_spec
    monkeypatch.setattr(
        metrics.importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    code = cli.main(["train", "--strategy", "serial", "--tensorboard", str(tmp_path / "tb")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "torchfleet train: error: --tensorboard needs the tensorboard package, which is not installed;"
        " run `pip install tensorboard` (or `pip install 'torchfleet[tensorboard]'`)"
    ]
    assert not (tmp_path / "tb").exists()  # refused before anything was made
