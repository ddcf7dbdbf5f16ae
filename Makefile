# The two commands of the README: `make demo` and `make test`.
# Each creates the virtual environment it needs, so a fresh clone needs nothing else.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# pip's own progress bars and the "location ignored" notes of local indexes are noise here.
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: demo test lint doctor clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(PIP) -e . 2>&1 | { grep -v "is ignored" || true; }
	$(BIN)/python -c "import torchfleet, torch, sklearn, rich"
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) -e '.[dev]' 2>&1 | { grep -v "is ignored" || true; }
	$(BIN)/python -c "import pytest, pytest_timeout"
	touch $@

demo: $(VENV)/.base
	$(BIN)/torchfleet train

test: $(VENV)/.dev
	$(BIN)/python -m pytest

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests

doctor: $(VENV)/.base
	$(BIN)/torchfleet doctor

clean:
	rm -rf $(VENV) .pytest_cache
