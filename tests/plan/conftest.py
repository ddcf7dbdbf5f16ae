"""Fixtures the planner's tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An XDG_CACHE_HOME for one test file's `plan` runs: the machine probe runs once a file, not once a test."""
    return tmp_path_factory.mktemp("cache")
