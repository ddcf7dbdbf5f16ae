"""Variables set in this process's environment for the workers it starts, and put back after."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def exported(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ (the workers inherit it) while the block runs; each variable as it was after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
