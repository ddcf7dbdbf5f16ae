"""A directory of checkpoints: each step's name, the newest intact one to resume from, and pruning.

Each checkpoint in it is a ``step-NNNNNNNN/`` directory written and checked by
verified.py; a save killed midway leaves a ``.step-NNNNNNNN.partial/`` (or a
``.old/`` being replaced) that nothing here lists, and `prune` deletes.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from torchfleet.checkpoint.verified import verify_together
from torchfleet.errors import UsageError

_NAME = re.compile(r"^step-(\d{8})$")
_STALE = re.compile(r"^\.step-\d{8}\.(partial|old)$")


def step_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Published checkpoints in `directory`, oldest first (partial saves ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir())


def newest_good(fleet, directory: str | os.PathLike, fallback: bool = False) -> tuple[Path, dict] | None:
    """(path, manifest) of the newest intact checkpoint, or None when there is none.

    A damaged newest checkpoint is an error naming its file, unless `fallback`
    asks to step back to the previous intact one (said on the main rank).
    """
    found = list_checkpoints(directory)
    for path in reversed(found):
        try:
            return path, verify_together(fleet, path)
        except UsageError as exc:
            if not fallback:
                raise UsageError(
                    f"{exc}; pass --resume-fallback to resume from the previous intact checkpoint"
                ) from None
            fleet.print(f"note: skipping {path}: {exc}")
    if found:  # starting over would overwrite them: the user decides
        raise UsageError(
            f"none of the {len(found)} checkpoints in {str(directory)!r} is intact; move them"
            " away to start from the beginning"
        )
    return None


def prune(directory: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, and partial saves left by crashes."""
    directory = Path(directory)
    for old in list_checkpoints(directory)[:-keep]:
        # Renamed away first: a kill during the deletion must not leave a
        # half-deleted directory under a checkpoint's name.
        doomed = old.with_name(f".{old.name}.old")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for stale in directory.iterdir():
        if _STALE.match(stale.name):
            shutil.rmtree(stale, ignore_errors=True)
