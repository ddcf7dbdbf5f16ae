"""plan's traced memory of the pipeline schedules beside 1f1b against the tensor peak of real processes.

tests/plan/test_plan_memory_traced.py says how (`plan --check`); this file holds the schedules, which the
newest torch runs all of (zbv needs 2.14), while CI's floor lane runs the per-model file.
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import plan_check
from torchfleet.strategies.pipeline.schedules import NEEDS_RELEASE
from torchfleet.versions import release

# Schedules beside 1f1b (every model's, in test_plan_memory_traced.py), each holding micro-batches its own way:
# gpipe every forward before any backward; interleaved-1f1b two stages a process and a longer warm-up; zbv a V of two stages whose
# backward is split in two (autograd.grad for the inputs, the weights later). looped-bfs and interleaved-zb were
# measured by hand (docs/benchmarks, plan accuracy).
# `make test` (CI) checks interleaved-1f1b, whose stages run two chunks each; gpipe and zbv (`slow`) take as long each.
SCHEDULES = [
    pytest.param("gpipe", marks=pytest.mark.slow),
    "interleaved-1f1b",
    pytest.param("zbv", marks=pytest.mark.slow),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_pipeline_schedules_traced_meet_real_processes_within_10_percent(schedule, cache, tmp_path):
    if release() < NEEDS_RELEASE.get(schedule, (0, 0)):
        pytest.skip(f"{schedule} is refused in one sentence on torch {torch.__version__.split('+')[0]} (schedules.py)")
    argv = [sys.executable, "-m", "torchfleet", "plan", "--model", "gpt", "--batch-size", "32"]
    argv += ["--strategies", "pipeline", "--nproc", "2", "--schedule", schedule]
    argv += [] if schedule == "gpipe" else ["--stages-per-process", "2"]  # 4 stages of gpt tiny's 4 blocks
    argv += ["--check", "--warmup", "1", "--steps", "2"]
    (cell,) = [c for c in plan_check(argv, cache, tmp_path)[0] if c["strategy"] == "pipeline"]
    print(
        f"gpt pipeline x2 {schedule}: predicted {cell['predicted_peak_bytes']:.0f}, measured {cell['measured_peak_bytes']}"
    )
    assert cell["status"] == "ok", cell["error"]
    assert cell["measured_peak_bytes"], cell["memory_note"]
    assert abs(cell["memory_ratio"] - 1) <= 0.10, cell["memory_ratio"]
