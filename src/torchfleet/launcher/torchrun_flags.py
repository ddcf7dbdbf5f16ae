"""Every flag of the installed torchrun, in both spellings, so `torchfleet run` is a drop-in.

The flags come from torchrun's own parser (`torch.distributed.run.get_args_parser`),
so a newer torch's new flag is accepted without a change here. torchfleet handles
some itself (processes, nodes, the master, restarts, the rendezvous endpoint and
id: `LaunchConfig`); the rest are handed to torchrun's own `config_from_args`,
and torchrun's agent configuration (log directory, redirects, tee, rank filters,
start method, role, rendezvous backend and options...) is carried into the agent
torchfleet starts; tests/launcher/test_torchrun_compat.py compares the two, field by field,
flag by flag. `-m`, `--no-python` and `--run-path` choose how each worker runs
the script, as under torchrun.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any

from torch.distributed.launcher.api import LaunchConfig as AgentConfig
from torch.distributed.run import config_from_args, get_args_parser

PREFIX = "torchrun__"  # namespace attributes of the flags passed through to torchrun
# Agent fields torchfleet sets from its own LaunchConfig (the flags it handles itself).
OWN_FIELDS = {"min_nodes", "max_nodes", "nproc_per_node", "run_id", "rdzv_endpoint", "max_restarts"}


# The rendezvous torchfleet chooses (elastic_config.agent_config): torchrun's values only where the
# user's flags changed them, and never on one machine, whose rendezvous stays on loopback.
RENDEZVOUS_FIELDS = {"rdzv_backend", "rdzv_configs", "local_addr"}


# Not launch flags: torchrun prints a shell-completion script for itself.
NOT_LAUNCH_FLAGS = {"print_completion"}


def torchrun_actions() -> list[argparse.Action]:
    """torchrun's launch flags (not -h, not the script and its arguments)."""
    return [
        a
        for a in get_args_parser()._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction) and a.dest not in NOT_LAUNCH_FLAGS
    ]


def add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """Add each torchrun flag `parser` does not have (those it has, torchfleet handles itself)."""
    taken = set(parser._option_string_actions)
    group = parser.add_argument_group("torchrun's other flags (passed to its agent as torchrun takes them)")
    for action in torchrun_actions():
        flags = action.option_strings
        if any(flag in taken for flag in flags):
            continue
        common = {"dest": PREFIX + action.dest, "default": argparse.SUPPRESS, "help": action.help}
        if action.nargs == 0:  # a switch: --standalone, -m, --no-python, --run-path
            group.add_argument(*flags, action="store_true", **common)
        else:
            typed = {"type": action.type} if action.type not in (None, str) else {}
            group.add_argument(*flags, **typed, choices=action.choices, metavar=action.metavar, **common)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The passed-through torchrun flags the user gave, by torchrun's own names."""
    return {k[len(PREFIX) :]: v for k, v in vars(args).items() if k.startswith(PREFIX)}


def _namespace(flags: dict[str, Any], script: str, script_args: list[str]) -> argparse.Namespace:
    ns = get_args_parser().parse_args([script])  # torchrun's defaults
    for key, value in flags.items():
        setattr(ns, key, value)
    ns.training_script_args = list(script_args)
    return ns


def agent_overrides(flags: dict[str, Any], script: str, script_args: list[str], one_machine: bool) -> dict[str, Any]:
    """torchrun's agent configuration for the given flags, less what torchfleet decides itself.

    Built by torchrun's own `config_from_args`, so every field torchfleet leaves to torchrun
    is torchrun's, given or not (its role "default", its empty duplicate filters, its log
    specs...). The rendezvous fields come from it only where the flags changed them (a
    baseline without flags tells); on one machine the rendezvous stays torchfleet's
    (loopback only, a free port), which is what `--standalone` asks of torchrun too.
    """
    quiet = logging.getLogger("torch.distributed.run")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its OMP_NUM_THREADS notice: torchfleet's agent decides that
    saved = os.environ.get("OMP_NUM_THREADS")
    try:
        theirs, _, _ = config_from_args(_namespace(flags, script, script_args))
        baseline, _, _ = config_from_args(_namespace({}, script, script_args))
    finally:
        quiet.setLevel(level)
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    overrides = {}
    for field in dataclasses.fields(AgentConfig):
        if field.name in OWN_FIELDS:
            continue
        mine, base = getattr(theirs, field.name), getattr(baseline, field.name)
        if field.name not in RENDEZVOUS_FIELDS:
            overrides[field.name] = mine
        elif mine != base and not one_machine:
            overrides[field.name] = mine
    return overrides
