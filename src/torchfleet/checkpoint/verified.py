"""Checkpoints that a crash cannot break, and that say so when they are broken.

A checkpoint is a directory ``step-00000025/``:

    state.pt        model and optimizer as full state dicts (strategies without sharding)
    model/          the same through torch.distributed.checkpoint (sharded strategies)
    ranks.pt        one entry per rank: RNG states, gradient scaler, `extra` (step, sampler)
    manifest.json   strategy, processes, layout, the model's shapes and the sha256 of
                    every file above; written last

It is written under ``.step-00000025.partial/``, every file fsynced, then
renamed into place, so at any moment (``kill -9`` included) the directory
holds the previous complete checkpoints and perhaps one partial one that
nothing reads. Loading checks every file against the manifest before
unpickling anything, and unpickles with ``weights_only=True``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from torchfleet.errors import UsageError

# Functions here take the Fleet as `fleet` without importing its class: the
# checkpoint layer sits below fleet.py, which calls it.

FORMAT = 2
MANIFEST = "manifest.json"
# A test hook, as train/faults.py's TORCHFLEET_FAULT is for training steps (that layer sits
# above this one): TORCHFLEET_KILL_IN_SAVE=STEP makes the main rank SIGKILL itself in the
# middle of saving step STEP, its model written and its manifest not, so a crash-safety test
# lands a kill -9 inside a save every time instead of by luck. For tests and drills only.
KILL_IN_SAVE = "TORCHFLEET_KILL_IN_SAVE"


# -- random generators ---------------------------------------------------------
def rng_state() -> dict:
    """Every random generator a training step may draw from, as plain tensors."""
    np_state = np.random.get_state(legacy=True)
    # The legacy form is a tuple for numpy's global generator (MT19937); numpy's stub says a
    # dict may come, which only other bit generators give.
    assert isinstance(np_state, tuple)
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` took. Its tensors may arrive on the GPU (ranks.pt is loaded onto the rank's
    device); every generator takes its state as a CPU tensor, hence `.cpu()`."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _as_tuple(value):
    # torch.load(weights_only=True) gives lists back where tuples went in.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# -- files -----------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # a rename or a new file must survive a power cut too
    finally:
        os.close(fd)


def _write(payload: Any, path: Path) -> None:
    with open(path, "wb") as fh:
        if isinstance(payload, bytes):
            fh.write(payload)
        else:
            try:
                torch.save(payload, fh)
            except RuntimeError:
                # torch.save's zip writer reports a failed write as a RuntimeError
                # ("unexpected pos"): when the disk is full, say so as the OS would.
                disk = os.statvfs(path.parent)
                if disk.f_bavail * disk.f_frsize < (1 << 20):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
                raise
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write(payload: Any, path: Path) -> None:
    """One file: temporary name, flush, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _write(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_shapes(state: dict) -> dict[str, list[int]]:
    """Name -> shape of every tensor in a model's state (DTensors give their global shape)."""
    return {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def global_shapes(fleet) -> dict[str, list[int]]:
    """The whole model's shapes, merged over ranks: a pipeline stage holds only its own layers."""
    local = model_shapes(fleet.strategy.unwrapped().state_dict())
    if not dist.is_initialized():
        return local
    every: list = [None] * fleet.world_size
    dist.all_gather_object(every, local)
    return {name: shape for shapes in every for name, shape in shapes.items()}


# -- save ------------------------------------------------------------------------
def save(fleet, path: str | os.PathLike, extra: dict | None = None, sharded: bool | None = None) -> None:
    """Write one checkpoint directory at `path`; every rank calls it (collective).

    `sharded` picks torch.distributed.checkpoint; None lets the strategy decide.
    A failed write leaves `path` and every other checkpoint as they were.
    """
    strategy = fleet.strategy
    sharded = getattr(strategy, "sharded_checkpoint", False) if sharded is None else sharded
    final = Path(path)
    tmp = final.parent / f".{final.name}.partial"
    per_rank = {"rng": rng_state(), "scaler": strategy.runtime.precision.state_dict(), "extra": extra or {}}
    try:
        if fleet.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            tmp.mkdir(parents=True)
        fleet.barrier()
        if sharded:
            # Imported here: torch's DCP (and DTensor with it) costs a second of a core in each process.
            from torchfleet.checkpoint import sharded as checkpoint_sharded

            checkpoint_sharded.save(strategy, tmp / "model")
            shapes = global_shapes(fleet)
        else:
            model_state, optimizer_state = strategy.state_dicts()  # may gather: all ranks take part
            shapes = model_shapes(model_state)
            if fleet.is_main:
                _write({"model": model_state, "optimizer": optimizer_state}, tmp / "state.pt")
        if fleet.is_main and os.environ.get(KILL_IN_SAVE) == str((extra or {}).get("step")):
            os.kill(os.getpid(), signal.SIGKILL)  # the test hook above
        ranks = [None] * fleet.world_size
        if dist.is_initialized():
            dist.all_gather_object(ranks, per_rank)
        else:
            ranks = [per_rank]
        if fleet.is_main:
            _write(ranks, tmp / "ranks.pt")
            manifest = {
                "format": FORMAT,
                "strategy": strategy.name,
                "world_size": fleet.world_size,
                "layout": "sharded" if sharded else "full",
                "step": (extra or {}).get("step"),
                "torch": torch.__version__,
                "model": shapes,
                "optimizer": type(strategy.optimizer).__name__,
                "files": {str(f.relative_to(tmp)): sha256(f) for f in sorted(tmp.rglob("*")) if f.is_file()},
            }
            _write(json.dumps(manifest, indent=1).encode(), tmp / MANIFEST)
            for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
                _fsync_dir(d)
            _publish(tmp, final)
    except OSError as exc:
        if fleet.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror or str(exc)
        raise UsageError(
            f"cannot write checkpoint {str(final)!r} ({reason}); the earlier checkpoints"
            " are untouched: free space or choose another --checkpoint-dir"
        ) from None
    fleet.barrier()


def _publish(tmp: Path, final: Path) -> None:
    old = final.parent / f".{final.name}.old"
    if final.exists():  # the same step saved again after a restart: move the old one aside first
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


# -- verify and load --------------------------------------------------------------
def verify(path: str | os.PathLike) -> dict:
    """The manifest of a complete, intact checkpoint; UsageError naming the first bad file."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"checkpoint {str(path)!r} does not exist (a checkpoint is a step-NNNNNNNN directory)")
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise UsageError(
            f"checkpoint {str(path)!r} has no {MANIFEST}: it is incomplete or not a torchfleet checkpoint"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"checkpoint file {str(manifest_path)!r} is corrupt (not a torchfleet manifest)") from None
    if manifest.get("format") != FORMAT:
        raise UsageError(
            f"checkpoint {str(path)!r} has format {manifest.get('format')}; this torchfleet reads format {FORMAT}"
        )
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise UsageError(f"checkpoint file {str(file)!r} is missing")
        if sha256(file) != digest:
            raise UsageError(
                f"checkpoint file {str(file)!r} is corrupt or truncated: its sha256 does not match {MANIFEST}"
            )
    return manifest


def verify_together(fleet, path: str | os.PathLike) -> dict:
    """`verify` on the main rank, its verdict shared, so every rank raises the same error or none."""
    outcome: list[Any] = [None]
    if fleet.is_main:
        try:
            outcome[0] = ("ok", verify(path))
        except UsageError as exc:
            outcome[0] = ("error", str(exc))
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise UsageError(value)
    return cast(dict, value)  # "ok": verify's report (the checker cannot tie value's type to kind's)


def check_fits(fleet, path: Path, manifest: dict, strategy_name: str | None = None) -> None:
    """UsageError when the checkpoint holds another model (or, when given, another strategy)."""
    if strategy_name is not None and manifest["strategy"] != strategy_name:
        raise UsageError(
            f"checkpoint {str(path)!r} was saved by strategy {manifest['strategy']!r} and this run uses"
            f" {strategy_name!r}; resume with --strategy {manifest['strategy']} or use another --checkpoint-dir"
        )
    optimizer = type(fleet.strategy.optimizer).__name__
    if manifest.get("optimizer", optimizer) != optimizer:
        raise UsageError(
            f"checkpoint {str(path)!r} was saved with optimizer {manifest['optimizer']} and this run"
            f" uses {optimizer}; use the same --optimizer or another --checkpoint-dir"
        )
    ours = global_shapes(fleet)
    theirs = manifest["model"]
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            if name not in theirs:
                what = f"this model's {name} {ours[name]} is not in it"
            elif name not in ours:
                what = f"its {name} {theirs[name]} is not in this model"
            else:
                what = f"{name} is {theirs[name]} there and {ours[name]} here"
            raise UsageError(
                f"checkpoint {str(path)!r} holds a different model: {what};"
                " use the same --model or another --checkpoint-dir"
            )


def load(fleet, path: str | os.PathLike, weights_only: bool = True, strategy_name: str | None = None) -> dict:
    """Load a checkpoint into the wrapped model and optimizer; returns this rank's `extra`.

    Files are checked against the manifest first, then unpickled with
    `weights_only=True`; pass False only for a checkpoint you trust whose
    `extra` holds arbitrary objects.
    """
    path = Path(path)
    manifest = verify_together(fleet, path)
    check_fits(fleet, path, manifest, strategy_name)
    strategy = fleet.strategy
    try:
        ranks = _torch_load(path / "ranks.pt", fleet, weights_only)
        if manifest["layout"] == "sharded":
            from torchfleet.checkpoint import sharded as checkpoint_sharded

            checkpoint_sharded.load(strategy, path / "model")
        else:
            state = _torch_load(path / "state.pt", fleet, weights_only)
            strategy.load_state_dicts(state["model"], state["optimizer"])
    except pickle.UnpicklingError as exc:
        raise UsageError(
            f"checkpoint {str(path)!r} refused: {exc}; it was not written by torchfleet or was"
            " altered, and loading it could run code"
        ) from None
    except (RuntimeError, KeyError, ValueError) as exc:
        if isinstance(exc, UsageError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"checkpoint {str(path)!r} does not fit this model and optimizer: {first}") from None
    mine = ranks[fleet.rank] if fleet.rank < len(ranks) else ranks[0]  # fewer ranks saved: reuse rank 0's
    strategy.runtime.precision.load_state_dict(mine["scaler"])
    set_rng_state(mine["rng"])
    return mine["extra"]


def _torch_load(file: Path, fleet, weights_only: bool):
    try:
        return torch.load(file, map_location=fleet.device, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the file is unusable
        hint = (
            (
                "; it holds objects other than tensors and plain values: load it with weights_only=False"
                " only if you trust its source"
            )
            if weights_only and "weights_only" in str(exc)
            else ""
        )
        raise UsageError(f"checkpoint file {str(file)!r} cannot be read ({type(exc).__name__}){hint}") from None
