"""`torchfleet train` settles the strategy once, in the process that read the command line; its workers
train what it carried to them, without parsing the command line or settling the strategy again."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from helpers import clean_env, torchfleet

# Loaded by every interpreter of the run (the launcher, the forkserver its workers fork from, hogwild's
# workers): it notes each settle and each command-line parse, with the process that made it.
RECORDER = """
import argparse
import os

if "TORCHFLEET_TEST_RECORD" in os.environ:

    def _note(what):
        with open(os.environ["TORCHFLEET_TEST_RECORD"], "a") as out:
            out.write(f"{what} {os.getpid()}\\n")

    _parse = argparse.ArgumentParser.parse_known_args

    def _parse_noted(self, *args, **kwargs):
        _note("parse")
        return _parse(self, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = _parse_noted

    from torchfleet import strategy_spec

    _settle = strategy_spec.settle

    def _settle_noted(*args, **kwargs):
        _note("settle")
        return _settle(*args, **kwargs)

    strategy_spec.settle = _settle_noted
"""


@pytest.mark.parametrize("strategy", ["ddp", "hogwild"])
def test_train_settles_once_in_the_launcher(tmp_path, strategy):
    (tmp_path / "sitecustomize.py").write_text(RECORDER)
    record, result = tmp_path / "record.txt", tmp_path / "result.json"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    env = clean_env(PYTHONPATH=path, TORCHFLEET_TEST_RECORD=str(record))
    args = ["--epochs", "1", "--max-steps", "2", "--no-progress", "--json-out", str(result)]
    done = torchfleet("train", "--strategy", strategy, "-n", "2", *args, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(result.read_text())["world_size"] == 2  # two workers trained
    notes = [line.split() for line in record.read_text().splitlines()]
    launcher = {pid for what, pid in notes if what == "parse"}
    assert len(launcher) == 1, notes  # the command line was parsed in one process only, not in a worker
    assert Counter(what for what, _ in notes)["settle"] == 1, notes
    assert {pid for what, pid in notes if what == "settle"} == launcher, notes  # and settled there
