"""A user's own model named MODULE:FUNCTION (train, bench and plan's --model), imported as Python imports it.

MODULE is imported from the current directory, or given as a path (``my_models/net.py:build``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

from torchfleet.errors import UsageError


def is_user_model(name: str) -> bool:
    return ":" in name


def user_function(name: str) -> Callable:
    where, _, attr = name.rpartition(":")
    if not where or not attr:
        raise UsageError(f"--model {name!r} is not MODULE:FUNCTION (e.g. mymodels:build) nor a built-in model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` finds modules
    try:
        if where.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if spec is None or spec.loader is None or not Path(where).is_file():
                raise ImportError(f"no file {where}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise UsageError(
            f"--model {name!r}: cannot import {where!r} ({exc}); run from the directory that"
            " holds it, or give its path (path/to/file.py:FUNCTION)"
        ) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise UsageError(f"--model {name!r}: {where!r} has no function {attr!r}")
    return function
