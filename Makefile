# The two commands of the README: `make demo` and `make test`.
# Each creates the virtual environment it needs, so a fresh clone needs nothing else.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# pip's own progress bars and the "location ignored" notes of local indexes are noise here.
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: demo test lint doctor clean system-deps

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

# Best effort: the multi-machine tests need `ip`/`tc` (iproute2) and `mpirun` (openmpi-bin);
# without them those tests skip and say why. Installs only as root with apt-get, and only
# what is missing, so an up-to-date machine pays two `command -v` calls.
SYSTEM_DEPS := mpirun:openmpi-bin ip:iproute2 tc:iproute2

system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do \
	  command -v "$${dep%%:*}" >/dev/null 2>&1 || missing="$$missing $${dep##*:}"; done; \
	missing=$$(echo $$missing | tr ' ' '\n' | sort -u | tr '\n' ' '); \
	if [ -z "$${missing// /}" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "system-deps: installing $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null \
	    || echo "system-deps: apt-get failed; the tests that need $$missing will skip"; \
	else \
	  echo "system-deps: skipped (needs root and apt-get): $$missing; the tests that need them will skip"; \
	fi

test: $(VENV)/.dev system-deps
	$(BIN)/python -m pytest

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests

doctor: $(VENV)/.base
	$(BIN)/torchfleet doctor

clean:
	rm -rf $(VENV) .pytest_cache
