"""Shared helpers: run torchfleet as a user would, in a real subprocess, with a timeout.

A plain module, imported by name (`from helpers import run`) from any folder of tests/ (pyproject puts
tests/ on the path): each folder may have a conftest.py of its own, so `from conftest import` would be
ambiguous."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# Variables that would make a child think it is already part of a job.
_CLUSTER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SM_HOSTS",
    "SM_CURRENT_HOST",
)


# Set by .ci/run: a test that needs something of the machine (root, network namespaces,
# mpirun, a Slurm cluster, mounts) fails where it would skip, so that CI cannot go green
# with the multi-host, MPI or Slurm tests silently left out ("-ra" only lists skips).
REQUIRE_SYSTEM = "TORCHFLEET_REQUIRE_SYSTEM_TESTS"


def require_system(reason: str) -> NoReturn:
    """Skip the calling test (or module) for `reason` (what the machine lacks), or fail it when
    TORCHFLEET_REQUIRE_SYSTEM_TESTS is set to anything but "" or "0"."""
    if os.environ.get(REQUIRE_SYSTEM, "") not in ("", "0"):
        pytest.fail(f"{reason}; {REQUIRE_SYSTEM} is set, so this test must run here, not skip", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, reason: str):
    """The module `name` (an extra the project's Makefile installs for its tests), or the calling test or
    module skipped for `reason`; under TORCHFLEET_REQUIRE_SYSTEM_TESTS its absence fails instead, so that CI
    cannot go green with the torchft, transformers or notebook tests left out."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require_system(f"{reason} ({exc})")


def whole_grids(config) -> bool:
    """Whether a grid of cells (the zoo's models by strategy) is trained whole: under `make test-all` or a bare
    pytest, where `-m` does not leave the `slow` tier out. `make test` (CI) trains a sample, the floor lane a smaller one."""
    return not config.getoption("floor_lane") and "not slow" not in (config.getoption("markexpr") or "")


def slow_before(version: tuple[int, int], why: str):
    """The `slow` tier's mark on torch older than `version` (CI's floor lane), where `why` takes minutes; no mark
    from `version` on."""
    from torchfleet.versions import release

    return pytest.mark.slow(why) if release() < version else (lambda test: test)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(args: list[str], timeout: float = 120, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run a command, failing the test (not hanging it) past `timeout` seconds."""
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=cwd or ROOT
    )


def torchfleet(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torchfleet", *args], timeout=timeout, env=env)


# 150 s, under pytest's 180: a plan that takes 20 s alone took over 60 s in CI's two lanes side by side (30 Nov).
def forked_torchfleet(*args: str, timeout: float = 150, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchfleet` as `torchfleet()` runs it, in a child forked from a process that imported torch once.

    For the many rows that check a help page or a refusal: each is still a
    process of its own with its own exit status and stderr (see
    torchfleet.testing.cli), two seconds sooner. A few tests keep the real
    `python -m torchfleet`, so the entry point itself stays covered.
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():  # not on Windows
        return torchfleet(*args, timeout=timeout, env=env)
    from torchfleet.testing.cli import forked_cli

    return forked_cli(list(args), env or clean_env(), str(ROOT), timeout=timeout)


def on_two_ranks(target, tmp_path: Path, args_of=lambda rank: ()) -> dict:
    """Run `target(rank, init, found, *args_of(rank))` in two forked processes that may join one real process
    group at `init` (a file store under tmp_path); each puts (rank, value) on the queue `found`. {rank: value};
    either process failing fails the test."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    found = context.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [context.Process(target=target, args=(r, init, found, *args_of(r))) for r in range(2)]
    for p in procs:
        p.start()
    said = dict(found.get(timeout=50) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    return said


def tree_digest(path: Path) -> dict[str, str]:
    """Every file under `path` and its sha256: equal digests mean nothing changed."""
    import hashlib

    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def newest_checkpoint_model(directory: Path) -> tuple[str, dict]:
    """(name, model state) of the newest full checkpoint in `directory` (step-NNNNNNNN/state.pt)."""
    import torch

    newest = max(directory.glob("step-*"))
    return newest.name, torch.load(newest / "state.pt", weights_only=True)["model"]


def assert_refused_in_one_sentence(result, sentence: str) -> None:
    """A command's refusal as torchfleet promises it: exit status 2 and `sentence` on one line of stderr, no traceback."""
    assert result.returncode == 2, result.stderr
    assert sentence in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def said(codes, outputs) -> str:
    """Exit statuses and every process's whole output, as one failure message (pytest cuts a long repr short)."""
    return f"exit statuses {codes}" + "".join(f"\n--- {name}:\n{text}" for name, text in outputs.items())


def read_outputs(procs: list[subprocess.Popen], timeout: float, when: dict | None = None) -> list[str]:
    """Every process's whole output, read as it comes; `when` maps a process's index to (text, action): the
    action runs once, as soon as that process prints a line holding the text. Past `timeout` seconds the
    processes are killed and the test fails with what they printed."""
    lines: list[list[str]] = [[] for _ in procs]

    def read(i: int) -> None:
        text, action = (when or {}).get(i, (None, None))
        assert procs[i].stdout is not None
        for line in procs[i].stdout:
            lines[i].append(line)
            if text is not None and text in line:
                action()
                text = None

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"still running after {timeout:.0f} s: {[''.join(out)[-2000:] for out in lines]}")
    for reader in readers:
        reader.join(timeout=30)
    return ["".join(out) for out in lines]


def plan_check(argv: list[str], cache, tmp_path, timeout: float = 540) -> tuple[list[dict], dict]:
    """`plan ... --check`'s cells and the whole plan, its machine probe cached in `cache` (XDG_CACHE_HOME)."""
    out = tmp_path / "plan.json"
    result = run([*argv, "--json-out", str(out)], timeout=timeout, env=clean_env(XDG_CACHE_HOME=str(cache)))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(out.read_text())
    return document["check"]["cells"], document
