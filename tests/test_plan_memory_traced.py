"""plan's memory, traced on fake tensors, against the tensor peak of real processes: every built-in model, every
layout whose memory can be measured here, and the pipeline schedules.

`plan --check` predicts each layout's peak (the profile measured on fake tensors at the ranks' own batches; the
FSDP2 and DTensor layouts, mp and the pipelines traced whole on a fake process group, plan/layout_trace.py, each
pipeline stage's rank in turn), then runs the same layouts in real Gloo processes and reads each rank's tensor peak
(TensorMemory). Issue 37 asks for 10%; measured (28 Nov 2026, torch 2.14.1) every traced cell is within 0.5% of
the largest real rank (a pipeline's within 0.3%, gpt-moe's real routing against the trace's balanced one), and ep,
whose memory is still formulas, within 8% on a quiet machine (its activations come from a line through two batches
the timing probes choose, and a loaded machine chooses smaller ones: 0.85 was seen while another test suite ran).

Each model runs at a batch where one block's reduce-scatter copy, which Gloo's worker thread sometimes frees
late (the plan's second figure), is a small part of the peak; at gpt tiny's 8 sequences the two figures differ by
16% and either may be what a run measures.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import clean_env, run

# model, global batch, extra flags, process counts; the layouts each one's plan must give (beyond EVERY_MODEL's,
# which every model runs). resnet50 runs on 2 processes alone: its 4-process layouts are resnet18's, cut alike,
# and they took a minute of CI's time.
MODELS = [
    ("mlp", 512, [], "2,4", set()),
    ("cnn", 64, [], "2,4", set()),
    ("transformer", 64, [], "2,4", set()),
    ("gpt", 32, [], "2,4", {"tp", "fsdp+tp"}),
    ("gpt-moe", 32, [], "2,4", {"tp", "fsdp+tp", "ep", "fsdp+ep"}),
    ("resnet18", 32, ["--image-size", "32"], "2,4", set()),
    ("resnet50", 16, ["--image-size", "32"], "2", set()),
]
EVERY_MODEL = {"serial", "hogwild", "mp", "ddp", "fsdp", "pipeline"}
ON_FOUR = {"hsdp", "ddp+pipeline", "fsdp+pipeline"}  # layouts of 2 x 2
MEASURED = ",".join(sorted(EVERY_MODEL | ON_FOUR | {"tp", "fsdp+tp", "ep", "fsdp+ep"}))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One calibration for all the models: the probes run once."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, batch, flags, nproc, more", MODELS, ids=[m[0] for m in MODELS])
def test_the_traced_memory_meets_real_processes_within_10_percent(model, batch, flags, nproc, more, cache, tmp_path):
    argv = [sys.executable, "-m", "torchfleet", "plan", "--model", model, "--batch-size", str(batch), *flags]
    argv += ["--strategies", MEASURED, "--nproc", nproc, "--check", "--warmup", "1", "--steps", "2"]
    cells = _check(argv, cache, tmp_path)
    expected = EVERY_MODEL | more | (ON_FOUR if "4" in nproc else set())
    assert expected <= {c["strategy"] for c in cells}, "a layout the model runs went unchecked"
    for cell in cells:
        name = f"{cell['strategy']} x{cell['processes']}"
        print(f"{model} {name}: predicted {cell['predicted_peak_bytes']:.0f}, measured {cell['measured_peak_bytes']}")
        assert cell["status"] == "ok", (name, cell["error"])
        assert cell["measured_peak_bytes"], (name, cell["memory_note"])
        assert abs(cell["memory_ratio"] - 1) <= 0.10, (name, cell["memory_ratio"])


def _check(argv: list[str], cache, tmp_path) -> list[dict]:
    out = tmp_path / "plan.json"
    result = run([*argv, "--json-out", str(out)], timeout=540, env=clean_env(XDG_CACHE_HOME=str(cache)))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())["check"]["cells"]


# Schedules beside 1f1b (every model's above), each holding micro-batches its own way: gpipe every forward
# before any backward; interleaved-1f1b two stages a process and a longer warm-up; zbv a V of two stages whose
# backward is split in two (autograd.grad for the inputs, the weights later). looped-bfs and interleaved-zb were
# measured by hand (docs/benchmarks, plan accuracy).
SCHEDULES = ["gpipe", "interleaved-1f1b", "zbv"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_pipeline_schedules_traced_meet_real_processes_within_10_percent(schedule, cache, tmp_path):
    argv = [sys.executable, "-m", "torchfleet", "plan", "--model", "gpt", "--batch-size", "32"]
    argv += ["--strategies", "pipeline", "--nproc", "2", "--schedule", schedule]
    argv += [] if schedule == "gpipe" else ["--stages-per-process", "2"]  # 4 stages of gpt tiny's 4 blocks
    argv += ["--check", "--warmup", "1", "--steps", "2"]
    (cell,) = [c for c in _check(argv, cache, tmp_path) if c["strategy"] == "pipeline"]
    print(
        f"gpt pipeline x2 {schedule}: predicted {cell['predicted_peak_bytes']:.0f}, measured {cell['measured_peak_bytes']}"
    )
    assert cell["status"] == "ok", cell["error"]
    assert cell["measured_peak_bytes"], cell["memory_note"]
    assert abs(cell["memory_ratio"] - 1) <= 0.10, cell["memory_ratio"]
