"""plan's memory, traced on fake tensors, against the tensor peak of real processes: every built-in model and every
layout whose memory can be measured here (the pipeline schedules beside 1f1b: test_plan_memory_schedules.py).

`plan --check` predicts each layout's peak (the profile measured on fake tensors at the ranks' own batches; the
FSDP2 and DTensor layouts, ep and fsdp+ep, mp and the pipelines traced whole on a fake process group,
plan/layout_trace.py, each pipeline stage's rank in turn), then runs the same layouts in real Gloo processes and
reads each rank's tensor peak (TensorMemory). Issue 37 asks for 10%; measured (28 Nov 2026, torch 2.14.1) every
traced cell is within 0.5% of the largest real rank (a pipeline's within 0.3%) but gpt-moe's ep x4, whose real
routing sends one rank 4.6% more than the trace's balanced one. ep was formulas before (issue 61): a line through
two batches the timing probes chose, which a loaded machine chose smaller (0.85 was seen under CI's own load).

Each model runs at a batch where one block's reduce-scatter copy, which Gloo's worker thread sometimes frees
late (the plan's second figure), is a small part of the peak; at gpt tiny's 8 sequences the two figures differ by
16% and either may be what a run measures.
"""

from __future__ import annotations

import sys

import pytest

from helpers import plan_check

ON_FOUR = {"hsdp", "ddp+pipeline", "fsdp+pipeline"}  # layouts of 2 x 2
# model, global batch, extra flags, process counts; the layouts each one's plan must give (beyond EVERY_MODEL's,
# which every model runs). resnet50 runs on 2 processes alone: its 4-process layouts are resnet18's, cut alike,
# and they took a minute of CI's time. So do mlp, cnn and transformer: the 2 x 2 layouts (hsdp, ddp+pipeline,
# fsdp+pipeline) are traced by the same code for every model, and gpt and resnet18 hold them. gpt-moe leaves
# them to those two as well: beside 2 busy processes its check took more than 540 s with them.
MODELS = [
    ("mlp", 512, [], "2", set()),
    ("cnn", 64, [], "2", set()),
    ("transformer", 64, [], "2", set()),
    ("gpt", 32, [], "2,4", {"tp", "fsdp+tp"} | ON_FOUR),
    ("gpt-moe", 32, [], "2,4", {"tp", "fsdp+tp", "ep", "fsdp+ep"}),
    ("resnet18", 32, ["--image-size", "32"], "2,4", ON_FOUR),
    ("resnet50", 16, ["--image-size", "32"], "2", set()),
]
EVERY_MODEL = {"serial", "hogwild", "mp", "ddp", "fsdp", "pipeline"}
# The layouts whose memory is traced on a fake process group (plan/layout_trace.py), not drawn from the profile's
# line: a formula's figure moves with the batches the timing probes choose, and so with the machine's load.
TRACED = {"fsdp", "hsdp", "tp", "fsdp+tp", "ep", "fsdp+ep", "mp", "pipeline", "ddp+pipeline", "fsdp+pipeline"}


# gpt-moe's check takes 317 s on the idle machine, more than 540 s beside 2 busy processes with the 2 x 2
# layouts (29 Nov): its slowest real processes get room, and a hang still fails.
# `make test` (CI) checks mlp, whose layouts run the same traces as every model's (fsdp, mp, pipeline on a fake
# process group); the others take minutes each (resnet50 510 s beside CI's other lane) and run under `make test-all`.
CASES = [pytest.param(*m, id=m[0], marks=() if m[0] == "mlp" else pytest.mark.slow) for m in MODELS]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model, batch, flags, nproc, more", CASES)
def test_the_traced_memory_meets_real_processes_within_10_percent(model, batch, flags, nproc, more, cache, tmp_path):
    argv = [sys.executable, "-m", "torchfleet", "plan", "--model", model, "--batch-size", str(batch), *flags]
    expected = EVERY_MODEL | more
    argv += ["--strategies", ",".join(sorted(expected)), "--nproc", nproc, "--check", "--warmup", "1", "--steps", "2"]
    cells, document = plan_check(argv, cache, tmp_path, timeout=840)
    assert expected <= {c["strategy"] for c in cells}, "a layout the model runs went unchecked"
    traced = {p["strategy"] for p in document["predictions"] if "peak_freed_promptly" in p["memory"]}
    assert expected & TRACED <= traced, (expected & TRACED - traced, document["notes"])
    for cell in cells:
        name = f"{cell['strategy']} x{cell['processes']}"
        print(f"{model} {name}: predicted {cell['predicted_peak_bytes']:.0f}, measured {cell['measured_peak_bytes']}")
        assert cell["status"] == "ok", (name, cell["error"])
        assert cell["measured_peak_bytes"], (name, cell["memory_note"])
        assert abs(cell["memory_ratio"] - 1) <= 0.10, (name, cell["memory_ratio"])
