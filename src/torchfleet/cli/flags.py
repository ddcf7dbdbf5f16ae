"""Command-line flags derived from a config dataclass, and the config built back from them.

A field declared with `torchfleet.config.option` is its own flag, as torchtitan's
JobConfig and Lightning's CLI derive flags from typed config: one edit of the
dataclass adds an option, its help text beside it. Fields declared otherwise
(`TrainConfig.strategy_options`) are not flags; the command fills them itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing


def is_flag(f: dataclasses.Field) -> bool:
    return "help" in f.metadata


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config: type) -> None:
    """One flag per option field of `config`, in the fields' order (the order of --help)."""
    hints = typing.get_type_hints(config)
    for f in filter(is_flag, dataclasses.fields(config)):
        settings = dict(f.metadata)
        kinds = [k for k in typing.get_args(hints[f.name]) or (hints[f.name],) if k is not type(None)]
        name = f.name.replace("_", "-")
        if kinds == [bool] and "nargs" not in settings:
            # A switch that is on by default can only be turned off: --no-progress sets progress=False.
            settings["action"] = "store_false" if f.default else "store_true"
            name = f"no-{name}" if f.default else name
        elif kinds in ([int], [float]):
            settings["type"] = kinds[0]
        elif kinds != [str] and not {"type", "nargs"} & settings.keys():
            # Refused rather than parsed as a string that the config would then hold as if typed.
            raise TypeError(
                f"{config.__name__}.{f.name}: a flag of type {hints[f.name]} needs type= or nargs= in its option()"
            )
        parser.add_argument(f"--{name}", dest=f.name, default=f.default, **settings)


def from_args(config: type, args: argparse.Namespace, **rest):
    """`config` from the parsed flags its option fields made, and `rest` for its other fields."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(config) if is_flag(f)}
    return config(**given, **rest)
