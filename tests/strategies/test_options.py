"""Strategy options: declared once in typed groups, and every reader sees the same groups."""

import dataclasses

import pytest

from torchfleet.cli import build_parser
from torchfleet.errors import UsageError
from torchfleet.strategies import options as strategy_options
from torchfleet.strategies import resolve_dims
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategy_spec import settle


def _flags(parser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {o for a in sub._actions for o in a.option_strings}


def test_every_declared_option_is_a_flag_of_train_and_bench_and_nothing_else_is():
    declared = {flag for flag, _, _ in strategy_options.flags()}
    assert len(declared) == 20  # tp_plan is Fleet's keyword only: a dict of ParallelStyles has no flag
    parser = build_parser()
    for command in ("train", "bench"):
        assert declared <= _flags(parser, command)
    # Each option sits in exactly one group.
    names = [o.name for kind in strategy_options.GROUPS.values() for o in dataclasses.fields(kind)]
    assert len(names) == len(set(names)) == len(strategy_options.NAMES) == 21


def test_options_are_sorted_into_their_groups_and_given_back_flat():
    given = {
        "pp": 2,
        "schedule": "gpipe",
        "microbatches": 4,
        "fsdp_units": "Block",
        "sync_every": 10,
        "grad_compression": "fp16",
        "sync_batchnorm": True,
        "devices": "cpu,cpu",
        "tp": None,
    }
    options = StrategyOptions.of(given)
    assert options.degrees.pp == 2 and options.degrees.tp is None
    assert (options.pipeline.schedule, options.pipeline.microbatches) == ("gpipe", 4)
    assert options.sharding.fsdp_units == "Block"
    assert options.replica_groups.sync_every == 10
    assert options.compression.grad_compression == "fp16"
    assert options.replication.sync_batchnorm is True
    assert options.single_process.devices == "cpu,cpu"
    assert options.given() == {k: v for k, v in given.items() if v is not None}


def test_an_undeclared_option_reaches_the_class_which_refuses_it_in_one_sentence(monkeypatch):
    from torchfleet.env import DistEnv

    spec = settle("serial", {"warp": 9}, DistEnv(), None)
    assert spec.options.undeclared == (("warp", 9),)
    with pytest.raises(UsageError, match="option 'warp' does not apply to strategy 'serial'; it takes no options"):
        spec.build(runtime=None)  # type: ignore[arg-type]
    # A degree given to a one-process strategy reaches it too (a mesh strategy's mesh takes them).
    with pytest.raises(UsageError, match="option 'pp' does not apply to strategy 'serial'"):
        settle("serial", {"pp": 2}, DistEnv(), None).build(runtime=None)  # type: ignore[arg-type]


def test_the_preset_defaults_come_under_the_callers_options_in_their_groups():
    from torchfleet.env import DistEnv

    # diloco's meetings are read from the replica-group group; what is left is ddp's, inside each group.
    with pytest.raises(UsageError, match="--sync-every 0 must be a whole number of steps"):
        settle("diloco", {"sync_every": 0}, DistEnv(), None)
    # A pipeline's options are checked where the degrees are: a schedule needing 2 stages a process.
    with pytest.raises(UsageError, match="zbv"):
        resolve_dims("pipeline", 2, options={"schedule": "zbv"})
