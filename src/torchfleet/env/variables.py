"""A launcher's variables read as typed values, and EnvError when one is missing or malformed.

The detectors (dist_env.py, slurm_layout.py) read every variable through these.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchfleet.errors import UsageError

DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500  # torchrun's default


class EnvError(UsageError):  # UsageError is a ValueError: the CLI shows the sentence, exit 2
    """A launcher's variable is missing, malformed or inconsistent."""


def has(environ: Mapping[str, str], *names: str) -> bool:
    return all(name in environ for name in names)


def first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(name, value) of the first of ``names`` that is set, else None."""
    for name in names:
        if name in environ:
            return name, environ[name]
    return None


def integer(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    """The first of ``names`` that is set, as an int; ``default`` if none is."""
    found = first(environ, *names)
    if found is None:
        if default is None:
            raise EnvError(f"{' or '.join(names)} is not set (expected an integer)")
        return default
    name, raw = found
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer (expected e.g. 0 or 4)") from None


def master_port(environ: Mapping[str, str], default: int = DEFAULT_PORT) -> int:
    return integer(environ, "MASTER_PORT", default=default)
