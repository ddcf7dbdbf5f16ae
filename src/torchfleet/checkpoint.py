"""Checkpoints that a crash cannot break.

A save is written to a temporary name in the same directory, flushed to disk,
then renamed over the final name: at any moment the directory holds either
the previous good checkpoint or the new complete one, never half a file.
Only the main rank writes; the others wait at a barrier so nobody races ahead
and reads a file that is not there yet.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from torchfleet.errors import UsageError

if TYPE_CHECKING:
    from torchfleet.fleet import Fleet

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})\.pt$")


def rng_state() -> dict:
    """Every random generator a training step may draw from, as plain tensors."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value):
    # torch.load(weights_only=True) gives lists back where tuples went in.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def atomic_write(payload: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must survive a power cut
    finally:
        os.close(dir_fd)


def save(fleet: "Fleet", path: str | os.PathLike, extra: dict | None = None) -> None:
    strategy = fleet.strategy
    model_state, optimizer_state = strategy.state_dicts()
    payload = {
        "format": FORMAT,
        "strategy": strategy.name,
        "world_size": fleet.world_size,
        "model": model_state,
        "optimizer": optimizer_state,
        "scaler": strategy.runtime.precision.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }
    if fleet.is_main:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(payload, path)
    if dist.is_initialized():
        dist.barrier()


def load(fleet: "Fleet", path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {str(path)!r} does not exist")
    try:
        payload = torch.load(path, map_location=fleet.device, weights_only=True)
    except Exception as exc:  # any unpickling failure means the file is not usable
        raise UsageError(f"checkpoint {str(path)!r} cannot be read ({type(exc).__name__}); it is corrupt or not a torchfleet checkpoint") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UsageError(f"checkpoint {str(path)!r} is not a torchfleet checkpoint of format {FORMAT}")
    strategy = fleet.strategy
    try:
        strategy.load_state_dicts(payload["model"], payload["optimizer"])
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise UsageError(f"checkpoint {str(path)!r} does not fit this model: {first}") from None
    strategy.runtime.precision.load_state_dict(payload["scaler"])
    set_rng_state(payload["rng"])
    return payload["extra"]


def step_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first (temporary files ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def prune(directory: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints."""
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
