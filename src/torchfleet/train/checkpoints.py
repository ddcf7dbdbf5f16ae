"""The built-in job's checkpoints: one saved with the loader's position and the loss, and the newest good one
resumed, resharded for whatever strategy and number of processes now run it."""

from __future__ import annotations

import torch

from torchfleet import checkpoint
from torchfleet.fleet import Fleet
from torchfleet.train.config import TrainConfig


def save(fleet: Fleet, cfg: TrainConfig, step: int, sampler, loss: torch.Tensor) -> int:
    """Checkpoint `step` with the loader's position and the step's loss (the mean over the ranks, as the summary
    gives it), which a run resumed at its last step reports as its final loss."""
    assert cfg.checkpoint_dir is not None  # called only with --checkpoint-dir
    final_loss = fleet.all_reduce(loss.detach(), op="mean").item()
    fleet.save(
        checkpoint.step_path(cfg.checkpoint_dir, step), step=step, sampler=sampler.state_dict(), final_loss=final_loss
    )
    if fleet.is_main and fleet.writes_checkpoints:  # replica groups: the group that wrote it
        checkpoint.prune(cfg.checkpoint_dir, cfg.keep_checkpoints)
    return step


def resume(fleet: Fleet, cfg: TrainConfig, sampler) -> tuple[int, float | None]:
    """(the step resumed at, its loss as saved) from the newest good checkpoint; (0, None) without one."""
    assert cfg.checkpoint_dir is not None  # called only with --checkpoint-dir
    found = checkpoint.newest_good(fleet, cfg.checkpoint_dir, fallback=cfg.resume_fallback)
    if found is None:  # --resume auto's first run, as any --resume with none there
        fleet.print(f"note: no checkpoint in {cfg.checkpoint_dir}; starting from the beginning")
        return 0, None
    path, manifest = found
    # Under any strategy and number of processes: torch.distributed.checkpoint reshards a sharded one, and a
    # full one is split by the strategy's own load (checkpoint/verified.py); the sampler counts global batches.
    extra = fleet.load(path)
    sampler.load_state_dict(extra["sampler"])
    saved_by = (manifest["strategy"], manifest["world_size"])
    moved = (
        ""
        if saved_by == (fleet.strategy_name, fleet.world_size)
        else (
            f", saved by {saved_by[0]} on {_processes(saved_by[1])} and resharded for {fleet.strategy_name} on"
            f" {_processes(fleet.world_size)}"
        )
    )
    fleet.print(f"resumed from {path} at step {extra['step']}{moved}")
    return extra["step"], extra.get("final_loss")  # older checkpoints hold no loss


def _processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")
