"""`torchfleet verify`: a shipped config's table, and a model whose tp split is wrong by construction caught."""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, require_module, torchfleet


@pytest.mark.timeout(400)
def test_a_shipped_config_shrunk_equals_serial_under_every_strategy_that_applies(tmp_path):
    require_module("transformers", "transformers (the test extra) builds the model from its config")
    out = tmp_path / "verify.json"
    result = torchfleet("verify", "--hf-config", "llama-3.1-8b", "--json-out", str(out), timeout=380)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "llama-3.1-8b (llama, shrunk to 4 layers of width 64), 5 SGD steps, 2 processes" in result.stdout
    doc = json.loads(out.read_text())
    rows = {row["strategy"]: row for row in doc["rows"]}
    assert list(rows) == ["ddp", "fsdp", "pipeline", "tp"]  # Llama: a plan (tp), no experts (no ep)
    for row in rows.values():
        assert row["verdict"] == "equal" and row["difference"] < 1e-5 and row["seconds"] > 0, row
        assert f"{row['strategy']:<16}" in result.stdout
    assert 0 <= doc["floor"] < 1e-6 and doc["bound"] == 1e-5  # SGD's few steps: float order moves nothing here
    assert "every strategy that ran trains this model to serial's weights" in result.stdout


@pytest.mark.timeout(300)
def test_a_model_split_wrong_by_construction_is_reported_as_differing(tmp_path):
    out = tmp_path / "verify.json"
    model = f"{ROOT / 'tests' / 'wrong_split.py'}:build"
    result = torchfleet("verify", "--model", model, "--strategies", "ddp,tp", "--json-out", str(out), timeout=280)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = {row["strategy"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["ddp"]["verdict"] == "equal" and rows["ddp"]["difference"] < 1e-6
    assert rows["tp"]["verdict"] == "differs" and rows["tp"]["difference"] > 1e-4, rows["tp"]
    assert "tp does not train this model to serial's weights" in result.stdout
