"""A strategy is declared once (strategies/registry.py): one more comes from another package, not from src/.

The plug-in below is a package of this test's own, found through its entry point the way pip would
install one: a module and a dist-info folder on PYTHONPATH. Its preset, "gpipe", is a pipeline whose
schedule defaults to GPipe; every command reaches it by its name alone.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from helpers import ROOT, clean_env, torchfleet
from torchfleet import UsageError
from torchfleet.strategies import get_strategy, registry, resolve_dims
from torchfleet.strategies.pipeline.strategy import Pipeline

PLUGIN = """
from torchfleet.strategies import Preset

GPIPE = Preset("gpipe", "a pipeline under the GPipe schedule", "2+ processes", {"pp": None},
               defaults={"schedule": "gpipe"})
"""


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict:
    where = tmp_path_factory.mktemp("plugin")
    (where / "tf_test_presets.py").write_text(PLUGIN)
    info = where / "tf_test_presets-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tf-test-presets\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torchfleet.strategies]\ngpipe = tf_test_presets:GPIPE\n")
    return clean_env(PYTHONPATH=os.pathsep.join([str(where), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))


def test_the_readme_table_is_the_registrys():
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- --8<-- \[start:strategies\] -->\n(.*?)\n\n", readme, re.S).group(1)
    assert table == registry.markdown_table(), (
        "README's table differs from registry.markdown_table():\n" + registry.markdown_table()
    )


def test_every_built_in_name_is_declared_once_and_resolves_to_its_class():
    names = registry.names()
    assert len(names) == len(set(names)) == 16
    for name in names:
        preset = registry.find(name)
        cls = get_strategy(name)
        assert cls.distributed == preset.mesh, name  # a preset of degrees runs on many processes
        dims = resolve_dims(name, preset.min_processes)
        assert (dims is None) == (not preset.mesh), name


@pytest.mark.parametrize(
    "bad, says",
    [
        (
            dict(name="x", summary="", needs="", degrees={"pp": None, "dp_shard": None}),
            "exactly one of dp_replicate, dp_shard, pp, tp None",
        ),
        (
            dict(name="x", summary="", needs="", degrees={"ep": None}),
            "exactly one of dp_replicate, dp_shard, pp, tp None",
        ),
        (dict(name="x", summary="", needs="", degrees={"cp": None}), "must name only dp_replicate"),
        (dict(name="x", summary="", needs=""), "give its degrees or the class"),
        (dict(name="x", summary="", needs="", degrees={"pp": None}, launch="ssh"), "launch 'ssh' is not one of"),
    ],
)
def test_a_bad_declaration_is_one_sentence(bad, says):
    with pytest.raises(UsageError, match=says):
        registry.Preset(**bad)


def test_a_taken_name_is_refused_and_a_new_one_resolves_in_this_process(monkeypatch):
    monkeypatch.setattr(registry, "_presets", dict(registry.presets()))  # undone after the test
    with pytest.raises(UsageError, match="'ddp' is registered already"):
        registry.register(registry.Preset("ddp", "", "", {"dp_shard": None}))
    registry.register(
        registry.Preset(
            "deep", "pipeline of 4 stages", "4 processes", {"dp_replicate": None, "pp": 4}, defaults={"microbatches": 8}
        )
    )
    assert get_strategy("deep") is Pipeline
    dims = resolve_dims("deep", 8)
    assert (dims.dp_replicate, dims.pp) == (2, 4)
    assert registry.options_for("deep", {"schedule": "gpipe"}) == {"microbatches": 8, "schedule": "gpipe"}
    assert registry.options_for("deep", {"microbatches": 4}) == {"microbatches": 4}  # a flag beats the default


def _lines(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.timeout(300)
def test_a_plugged_in_preset_trains_as_its_declaration_says(plugin_env, tmp_path):
    """train --strategy gpipe (the plug-in) ends with the weights of --strategy pipeline --schedule gpipe."""
    common = ("-n", "2", "--model", "gpt", "--max-steps", "3", "--epochs", "1", "--no-progress")
    plugged = torchfleet(
        "train",
        "--strategy",
        "gpipe",
        *common,
        "--save-model",
        str(tmp_path / "a.pt"),
        "--json-out",
        str(tmp_path / "a.json"),
        env=plugin_env,
        timeout=240,
    )
    assert plugged.returncode == 0, _lines(plugged)
    built_in = torchfleet(
        "train",
        "--strategy",
        "pipeline",
        "--schedule",
        "gpipe",
        *common,
        "--save-model",
        str(tmp_path / "b.pt"),
        env=plugin_env,
        timeout=240,
    )
    assert built_in.returncode == 0, _lines(built_in)
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((tmp_path / "a.json").read_text())
    # The class that ran it, under the preset's default schedule (1F1B's weights would be equal too).
    assert (report["strategy"], report["pipeline"]["schedule"]) == ("pipeline", "gpipe")
    # Without the plug-in the name is one sentence naming the strategies there are.
    alone = torchfleet("train", "--strategy", "gpipe", *common)
    assert alone.returncode == 2 and "gpipe" in alone.stderr and "Traceback" not in alone.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plugged_in_preset_is_in_doctor_bench_and_plan(plugin_env, tmp_path):
    doctor = torchfleet("doctor", "--json", env=plugin_env)
    assert doctor.returncode == 0, _lines(doctor)
    listed = {s["name"]: s for s in json.loads(doctor.stdout)["strategies"]}
    assert listed["gpipe"]["available"] == listed["pipeline"]["available"]

    plan = torchfleet(
        "plan",
        "--model",
        "gpt",
        "--strategies",
        "gpipe,pipeline",
        "--gpu",
        "H100",
        "--gpus-per-node",
        "2",
        "--nproc",
        "2",
        "--json-out",
        str(tmp_path / "plan.json"),
        env=plugin_env,
        timeout=240,
    )
    assert plan.returncode == 0, _lines(plan)
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "plan.json").read_text())["predictions"]}
    assert rows["gpipe"]["degrees"] == "pp2 m4 gpipe" and rows["pipeline"]["degrees"] == "pp2 m4"
    # The same pipeline under another schedule: same memory of state, another bubble.
    assert rows["gpipe"]["memory"]["training_state"] == rows["pipeline"]["memory"]["training_state"]

    bench = torchfleet(
        "bench",
        "--model",
        "gpt",
        "--strategies",
        "gpipe",
        "--nproc",
        "2",
        "--batch-sizes",
        "8",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--out",
        str(tmp_path / "bench"),
        env=plugin_env,
        timeout=240,
    )
    assert bench.returncode == 0, _lines(bench)
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    cells = {(r["strategy"], r["processes"]): r for r in results["cells"]}
    assert cells[("gpipe", 2)]["status"] == "ok", cells


def test_a_broken_plug_in_is_left_out_in_one_line_and_the_rest_runs(tmp_path):
    """A plug-in that fails to import, gives something else, or takes a taken name costs only itself."""
    (tmp_path / "tf_clash.py").write_text(PLUGIN.replace('"gpipe"', '"ddp"') + "\nNOT_A_PRESET = 3\n")
    info = tmp_path / "tf_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tf-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[torchfleet.strategies]\nmissing = tf_no_such_module:X\n"
        "number = tf_clash:NOT_A_PRESET\nclash = tf_clash:GPIPE\n"
    )
    env = clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    doctor = torchfleet("doctor", "--json", env=env)
    assert doctor.returncode == 0, _lines(doctor)
    assert [s["name"] for s in json.loads(doctor.stdout)["strategies"]] == list(registry.names())
    said = [line for line in doctor.stderr.splitlines() if "strategy entry point" in line]
    assert len(said) == 3 and "Traceback" not in doctor.stderr, doctor.stderr
    assert "missing (tf_no_such_module:X) is left out: it failed to load (ModuleNotFoundError" in said[0]
    assert "number (tf_clash:NOT_A_PRESET) is left out: it gave int 3, not a torchfleet.strategies.Preset" in said[1]
    assert "clash (tf_clash:GPIPE) is left out: strategy 'ddp' is registered already" in said[2]
