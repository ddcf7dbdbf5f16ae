"""Output paths, proven writable before any work is done.

A run that trains for an hour and then cannot write its result has lost the
hour. Every output flag is checked here first: its directory is created if
missing and a probe file is written and removed, so a bad path is one
sentence and exit status 2 before training, not a traceback after it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torchfleet.errors import UsageError


def _refuse(what: str, path: Path, exc: OSError, fix: str) -> UsageError:
    reason = exc.strerror or type(exc).__name__
    return UsageError(f"{what} {str(path)!r} is not writable ({reason}); {fix}")


def check_writable_dir(path: str | os.PathLike, what: str = "checkpoint directory") -> Path:
    """Create `path` if needed and prove it takes files."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".torchfleet-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise _refuse(what, path, exc, "choose a directory you can write to") from None
    return path


def check_writable_file(path: str | os.PathLike, what: str) -> Path:
    """Create `path`'s directory if needed and prove a file can be written there.

    An existing file is left as it is (it is replaced only when the run has
    its result); a directory in the file's place is refused.
    """
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {str(path)!r} is a directory; give a file name such as {str(path / 'result.json')!r}")
    try:
        check_writable_dir(path.parent, what)
    except UsageError:
        raise UsageError(
            f"{what} {str(path)!r} cannot be written: its directory {str(path.parent)!r}"
            " cannot be created or written; choose a path you can write to"
        ) from None
    return path


def write_text(path: str | os.PathLike, text: str, what: str) -> None:
    """Write `text` to `path` through a temporary file, so a failed write leaves the old file.

    If the write still fails (the disk filled up during the run), the text
    goes to stdout instead of being lost, and the error names the path.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass  # never created
        sys.stdout.write(text)
        sys.stdout.flush()
        raise UsageError(
            f"{what} {str(path)!r} could not be written ({exc.strerror or exc}); its contents are printed above"
        ) from None
