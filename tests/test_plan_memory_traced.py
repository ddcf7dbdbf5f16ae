"""plan's memory, traced on fake tensors, against the tensor peak of real processes: every built-in model, every
layout whose memory can be measured here.

`plan --check` predicts each layout's peak (the profile measured on fake tensors at the ranks' own batches; the
FSDP2 and DTensor layouts and mp traced whole on a fake process group, plan/layout_trace.py), then runs the same
layouts in real Gloo processes and reads each rank's tensor peak (MemTracker). Issue 37 asks for 10%; measured
(28 Nov 2026, torch 2.14.1) every cell but ep's is within 0.5%, ep on 4 at 7.2% (its routing is the real one,
the plan's balanced). The pipelines are not here: their memory is measured (--check) but not traced, and their
formulas fall short by up to 62% (docs/benchmarks, plan accuracy).

Each model runs at a batch where one block's reduce-scatter copy, which Gloo's worker thread sometimes frees
late (the plan's second figure), is a small part of the peak; at gpt tiny's 8 sequences the two figures differ by
16% and either may be what a run measures.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import clean_env, run

# model, global batch, extra flags; the layouts each one's plan must give (beyond serial, hogwild, mp, ddp, fsdp
# and hsdp, which every model runs).
MODELS = [
    ("mlp", 512, [], set()),
    ("cnn", 64, [], set()),
    ("transformer", 64, [], set()),
    ("gpt", 32, [], {"tp", "fsdp+tp"}),
    ("gpt-moe", 32, [], {"tp", "fsdp+tp", "ep", "fsdp+ep"}),
    ("resnet18", 32, ["--image-size", "32"], set()),
    ("resnet50", 16, ["--image-size", "32"], set()),
]
EVERY_MODEL = {"serial", "hogwild", "mp", "ddp", "fsdp", "hsdp"}
MEASURED = "serial,hogwild,mp,ddp,fsdp,hsdp,tp,fsdp+tp,ep,fsdp+ep"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One calibration for all the models: the probes run once."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, batch, flags, more", MODELS, ids=[m[0] for m in MODELS])
def test_the_traced_memory_meets_real_processes_within_10_percent(model, batch, flags, more, cache, tmp_path):
    out = tmp_path / "plan.json"
    argv = [sys.executable, "-m", "torchfleet", "plan", "--model", model, "--batch-size", str(batch), *flags]
    argv += ["--strategies", MEASURED, "--nproc", "2,4", "--check", "--warmup", "1", "--steps", "2"]
    result = run([*argv, "--json-out", str(out)], timeout=540, env=clean_env(XDG_CACHE_HOME=str(cache)))
    assert result.returncode == 0, result.stderr[-3000:]
    cells = json.loads(out.read_text())["check"]["cells"]
    assert EVERY_MODEL | more <= {c["strategy"] for c in cells}, "a layout the model runs went unchecked"
    for cell in cells:
        name = f"{cell['strategy']} x{cell['processes']}"
        print(f"{model} {name}: predicted {cell['predicted_peak_bytes']:.0f}, measured {cell['measured_peak_bytes']}")
        assert cell["status"] == "ok", (name, cell["error"])
        assert cell["measured_peak_bytes"], (name, cell["memory_note"])
        assert abs(cell["memory_ratio"] - 1) <= 0.10, (name, cell["memory_ratio"])
