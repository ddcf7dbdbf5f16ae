"""The supported torch range: one floor everywhere it is stated, doctor saying where torch stands."""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console

from helpers import ROOT
from torchfleet import versions
from torchfleet.doctor import collect_report, render_report
from torchfleet.errors import UsageError


def test_the_floor_is_the_same_everywhere():
    floor = "{}.{}".format(*versions.TORCH_FLOOR)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=([\d.]+)"', pyproject)[1] == floor
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_FLOOR := ([\d.]+)$", makefile, re.M)[1].startswith(floor + ".")
    assert f"Supported: torch {versions.tested_range()}." in (ROOT / "README.md").read_text()
    assert (ROOT / ".ci" / "run").read_text().count("make test-floor") == 1  # CI runs the floor lane


def test_this_torch_is_inside_the_tested_range():
    assert versions.TORCH_FLOOR <= versions.release() <= versions.TORCH_NEWEST_TESTED, torch.__version__


def test_standing_of_other_versions():
    assert versions.release("2.14.1+cu130") == (2, 14)
    assert versions.release("2.16.0.dev20261101") == (2, 16)
    assert versions.standing("2.11.0")[0] == "supported"
    verdict, sentence = versions.standing("2.9.1")
    assert verdict == "too old" and "torch 2.9.1 is older than 2.11" in sentence and "torch>=2.11" in sentence
    assert versions.standing("2.99.0")[0] == "newer than tested"


def test_an_old_torch_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    with pytest.raises(UsageError, match="older than 2.11, the oldest torchfleet supports"):
        versions.require_supported_torch()


def test_doctor_shows_the_version_and_the_range():
    report = collect_report(environ={})
    assert report["torch"]["support"] == "supported"
    assert report["torch"]["tested_range"] == versions.tested_range()
    buffer = io.StringIO()
    render_report(report, Console(file=buffer, width=200))
    text = " ".join(buffer.getvalue().split())
    assert f"{torch.__version__}" in text and f"inside the tested range {versions.tested_range()}" in text
