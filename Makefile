# The two commands of the README: `make demo` and `make test`.
# Each creates the virtual environment it needs, so a fresh clone needs nothing else.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The oldest torch torchfleet supports and CI tests (`make test-floor`). Empty:
# whatever pip installs for torch>= the floor, which is the newest it may.
TORCH_FLOOR := 2.11.0
TORCH ?=
# pip's own progress bars and the "location ignored" notes of local indexes are noise here.
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: demo test test-all test-floor floor-venv newest-lane-args lint format doctor bench parity gpu-check cpu-scaling clean system-deps docs docs-serve docs-screenshots

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(PIP) -e . $(if $(TORCH),"torch==$(TORCH)") 2>&1 | { grep -v "is ignored" || true; }
	$(BIN)/python -c "import torchfleet, torch, sklearn, rich, matplotlib"
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) -e '.[dev,plot]' "torch==$$($(BIN)/python -c 'import torch; print(torch.__version__.split("+")[0])')" \
		2>&1 | { grep -v "is ignored" || true; }
	$(BIN)/python -c "import pytest, pytest_timeout, matplotlib, transformers, plotly, bottle"
	touch $@

# Accelerate and Lightning for the parity benchmark only, with torch pinned to
# the version already installed so that neither can swap it for another.
$(VENV)/.parity: $(VENV)/.base
	$(PIP) -e '.[plot,parity]' "torch==$$($(BIN)/python -c 'import torch; print(torch.__version__.split("+")[0])')" \
		2>&1 | { grep -v "is ignored" || true; }
	$(BIN)/python -c "import accelerate, lightning.fabric"
	touch $@

# MkDocs, its Material theme and mkdocstrings for the docs site, torch pinned as for parity.
$(VENV)/.docs: $(VENV)/.base
	$(PIP) -e '.[docs]' "torch==$$($(BIN)/python -c 'import torch; print(torch.__version__.split("+")[0])')" \
		2>&1 | { grep -v "is ignored" || true; }
	$(BIN)/python -c "import mkdocs, material, mkdocstrings_handlers.python"
	touch $@

# The site, into site/. --strict: a broken link or anchor, a page missing from the nav, a snippet
# that is not there or a warning from the generated Reference fails the build (mkdocs.yml).
# Not --quiet: it keeps warnings out of --strict's count, and a broken link would pass (tried).
docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict 2>&1 | { grep -v '^INFO' || true; }
	@echo "docs: built site/ (open site/index.html)"

docs-serve: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

# Three pages of the built site as a reader sees them (headless Chromium, Debian's `chromium`),
# into docs/screenshots/: the home page, a guide, a generated reference page.
SCREENSHOTS := index.html:home guides/fault-tolerance/index.html:guide reference/commands/index.html:reference
docs-screenshots: docs
	@command -v chromium >/dev/null || { echo "docs-screenshots: needs chromium (apt-get install chromium)"; exit 2; }
	mkdir -p docs/screenshots
	for page in $(SCREENSHOTS); do \
	  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1400 \
	    --screenshot=docs/screenshots/$${page##*:}.png "file://$(CURDIR)/site/$${page%%:*}" 2>/dev/null; \
	done

demo: $(VENV)/.base
	$(BIN)/torchfleet train

# Programs some tests drive for real: mpirun (openmpi-bin), a Slurm cluster
# with munge, network namespaces and tbf (iproute2), a browser for the per-rank
# page (headless chromium, tests/view/test_view.py). Best-effort: installed
# only where we are root and have apt-get, and only what is missing; elsewhere
# those tests skip and say why (fail, under TORCHFLEET_REQUIRE_SYSTEM_TESTS=1, as in CI).
SYSTEM_PACKAGES := openmpi-bin slurm-wlm munge iproute2 chromium

system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing \
	      || echo "system-deps: could not install $$missing; the tests that need them will skip"; \
	  fi; \
	else echo "system-deps: not root with apt-get; tests needing $(SYSTEM_PACKAGES) skip where they are missing"; fi

# The tests marked `slow` (the planner's validation table and traces at scale, every model's traced memory
# against real processes, the zoo's whole grid, bench's ResNet-50, the cluster launchers' and namespace hosts'
# longest runs) are left out of `make test`, the README's and CI's command: each feature they cover keeps a
# cheaper test there, and with them a 2-core machine took 85 minutes for one lane (30 Nov), over CI's budget.
# `make test-all` runs them too (TIERS empty); run it where a change touches what they hold.
TIERS ?= not slow
only_tiers = $(if $(TIERS), and ($(TIERS)))

# The tests run in SHARDS + 1 pytest runs side by side: the tests marked `waits` (a lighthouse knocked on
# for 25 s, a join timeout, Slurm holding a requeued job, a slowed rank's sleeps: their processes mostly wait)
# in one, every other test in SHARDS parts (--shard, tests/conftest.py: whole files, balanced by their measured
# wall seconds). CI's two lanes left 29% of the 2 cores idle on 30 Nov (4,120 CPU-seconds of tests in 2,900 s),
# each part waiting on its tests' processes in turn; more runs side by side fill that time. The first part prints as it goes; the others' reports follow it, whichever failed (the
# recipe runs under bash -e: each status is caught, not left to end it); exit 5 (none selected) counts as
# passed. Ctrl-C or SIGTERM stops them all and all they started within seconds (tests/scripts/stop_suites.sh):
# each run is a session of its own, which the recipe's trap stops (make sends SIGTERM to the recipe's shell
# alone, and a background run would ignore SIGINT); `wait` lets the trap run at once.
SHARDS ?= 2
test: $(VENV)/.dev system-deps
	$(BIN)/python -c "import torch; print('make test: torch', torch.__version__)"
	@logs=$$(mktemp -d); pids=; others=; \
	trap 'tests/scripts/stop_suites.sh $$pids; rm -rf "$$logs"; echo "make test: stopped"; exit 130' INT TERM; \
	setsid $(BIN)/python -m pytest -m "waits$(only_tiers)" -p no:cacheprovider $(PYTEST_ARGS) > "$$logs/waits" 2>&1 & \
	pids=$$!; others="$$!:waits"; \
	for i in $$(seq 2 $(SHARDS)); do \
	  setsid $(BIN)/python -m pytest -m "not waits$(only_tiers)" -p no:cacheprovider --shard $$i/$(SHARDS) $(PYTEST_ARGS) \
	    > "$$logs/part-$$i-of-$(SHARDS)" 2>&1 & \
	  pids="$$pids $$!"; others="$$others $$!:part-$$i-of-$(SHARDS)"; \
	done; \
	setsid $(BIN)/python -m pytest -m "not waits$(only_tiers)" --shard 1/$(SHARDS) $(PYTEST_ARGS) & main=$$!; \
	pids="$$pids $$main"; status=0; wait $$main || status=$$?; \
	for entry in $$others; do \
	  code=0; wait $${entry%%:*} || code=$$?; \
	  echo "make test: $${entry#*:}, run beside the first part (exit $$code):"; cat "$$logs/$${entry#*:}"; \
	  [ $$code = 5 ] && code=0; [ $$code = 0 ] || status=$$code; \
	done; \
	rm -rf "$$logs"; [ $$status = 0 ]

# The oldest supported torch, in a venv of its own, runs the tests of what
# calls torch's distributed APIs, whose names and behaviour move between
# releases: the strategies on library models (FSDP2, DTensor and tensor
# parallel, pipelining and its schedules), checkpoints and resharding (DCP),
# the elastic agent and restarts, mixed precision and the
# communication hooks. The rest (launchers and cluster writers, bench, plan,
# the command line's surface, preemption and the namespace hosts) drives
# torchfleet's own code around those calls; the newest lane runs it, and
# every test but FLOOR_ONLY_TESTS (below).
# .ci/run runs this lane beside the newest one. On 30 Nov, before the `slow` tier, CI on 2 cores ran
# past its 90 minutes: the newest lane alone took 4,061 s (4,280 CPU-seconds) and the floor lane 5,370 s
# beside it; the tier leaves out of both what .ci/run prints as the costliest tests.
# pip keeps the downloaded wheels in its cache, so later runs install from disk.
# Of the floor lane's tests, the ones CI runs in the floor lane alone, so that its two lanes end together
# (.ci/run): the planner's traces at scale and its traced memory of each model against real processes (the
# newest lane's other plan tests, the schedules' memory among them, trace on its torch) and bench
# (torchfleet's own code around the strategies both lanes test). `make test` on its own runs them. Defined
# before FLOOR_TESTS, which names them: := expands at once. So do two of the cluster launchers' tests, Kubernetes'
# pods and mpirun (torch's env:// rendezvous under each, the same on every torch), the slow link's verdict on
# namespace hosts and preemption's save-and-resume (torchfleet's own signals and files). Most of these files'
# minutes are in the `slow` tier now; their cheaper tests still run here.
# The floor lane also trains a sample of the zoo's cells (--floor-lane, tests/strategies/test_zoo.py).
FLOOR_ONLY_TESTS := test_plan_at_scale test_plan_published test_plan_validation test_plan_encoders test_bench \
	test_plan_memory_traced test_kubernetes test_mpi test_slow_link test_preemption test_preempt_run
# Left to the newest lane since 30 Nov, for CI's time: the built-in models' grid (test_real_models, 190
# CPU-seconds on the floor; the zoo's sample and the checkpoint tests train ddp, fsdp and the pipelines there),
# torchft's groups (test_ft, 170: torchft's own releases carry its calls), SyncBatchNorm and the fault hooks.
FLOOR_TESTS := test_zoo test_schedules test_sharded_pipelined test_reshard \
	test_checkpoint test_tensor_parallel test_equivalence test_fp16_scaler \
	test_compression test_security test_single_process test_models test_layers test_hot_path \
	test_backend test_env test_data test_versions test_cuda test_elastic \
	test_weights $(FLOOR_ONLY_TESTS)

# Each name's file, in tests/ or the folder of the package it tests; a name with no file stops make.
files_of = $(foreach t,$(1),$(or $(wildcard tests/$(t).py tests/*/$(t).py),$(error no tests/$(t).py nor tests/*/$(t).py)))
FLOOR_FILES = $(call files_of,$(FLOOR_TESTS))

# pytest's arguments for CI's newest lane: every test but the floor lane's own.
newest-lane-args:
	@echo $(foreach f,$(call files_of,$(FLOOR_ONLY_TESTS)),--ignore=$(f))

# The floor lane's environment alone: CI builds it while the newest lane's tests run.
floor-venv:
	$(MAKE) .venv-floor/.dev VENV=.venv-floor TORCH=$(TORCH_FLOOR)

test-all:
	$(MAKE) test TIERS=

# One part: with two, CI's two lanes ran five pytest runs on 2 cores (30 Nov, load average 10), and tests whose
# hosts must start within a minute failed.
test-floor:
	$(MAKE) test VENV=.venv-floor TORCH=$(TORCH_FLOOR) SHARDS=1 PYTEST_ARGS="$(FLOOR_FILES) --floor-lane"

# ruff's formatting and rules, then basedpyright over src/ (pyproject's [tool.basedpyright]): it sees what ruff
# cannot, such as a call of an attribute torch does not have. --pythonpath: this venv's torch.
lint: $(VENV)/.dev
	$(BIN)/ruff format --check src tests docs/hooks benchmarks
	$(BIN)/ruff check src tests docs/hooks benchmarks
	$(BIN)/basedpyright --pythonpath $(BIN)/python

# What make lint's first line checks, applied.
format: $(VENV)/.dev
	$(BIN)/ruff format src tests docs/hooks benchmarks
	$(BIN)/ruff check --fix src tests docs/hooks benchmarks

doctor: $(VENV)/.base
	$(BIN)/torchfleet doctor

bench: $(VENV)/.dev
	$(BIN)/torchfleet bench

# Not part of `make test`: minutes of timing, printed as medians and ratios (docs/benchmarks/history.md).
parity: $(VENV)/.parity
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/parity.py

# On a machine with a CUDA GPU, in about 5 minutes (one H200, 16 cores): the GPU suite
# (tests/test_cuda.py, test_gpu_defaults.py), bench on gpt2 (bf16, eager and compiled) and
# resnet50 (fp32 and bf16, channels-last and not) with MFU and where the time goes, and
# cpu-scaling's figures, written as JSON and Markdown under GPU_OUT and packed as
# GPU_OUT.tar.gz; afterwards, on any machine, `benchmarks/gpu_check.py --plans-here
# GPU_OUT` adds the planner's prediction beside each measured cell (the script says how). It runs the interpreter that already has torch (GPU_PYTHON) with
# torchfleet taken from src/, installing nothing, since such machines often have no
# package index; it needs pytest, rich and scikit-learn there.
GPU_PYTHON ?= python3
GPU_OUT    ?= runs/gpu-check
GPU_RUN    := PYTHONPATH=$(abspath src) $(GPU_PYTHON)

gpu-check:
	$(GPU_RUN) benchmarks/gpu_check.py --out $(GPU_OUT)

# Where ddp's CPU scaling goes, on a machine of many cores (the GPU box's 16): at
# 2, 4 and 8 processes, torchfleet against the hand-written DDP loop, processes
# that never communicate (what the machine's cores and memory allow) and processes
# that only meet once per step (the floor of any synchronous step). A few minutes
# on 16 cores; gpu-check runs a shorter version of it (free and torchfleet, one
# round) beside its GPU work. Installs nothing, as gpu-check.
cpu-scaling:
	mkdir -p $(GPU_OUT)
	CUDA_VISIBLE_DEVICES= $(GPU_RUN) benchmarks/parity.py --only scaling --nprocs 2,4,8 \
		--scaling-ways free,lockstep,hand,torchfleet --rounds 3 --out $(GPU_OUT)/scaling-parts \
		| tee $(GPU_OUT)/scaling-parts.txt

clean:
	rm -rf $(VENV) .venv-floor .pytest_cache site
