"""The one training loop behind `torchfleet train`, for every strategy.

It runs inside each worker process (or the only process): the launcher has
already started the processes, and Fleet has joined them into a group.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import torch
from torch import nn

from torchfleet import checkpoint, outputs
from torchfleet.errors import TrainingError
from torchfleet.fleet import Fleet
from torchfleet.launcher.watchdog import Watchdog
from torchfleet.train import faults, report
from torchfleet.train.config import TrainConfig
from torchfleet.train.datasets import builtin_dataset
from torchfleet.train.hogwild import train_hogwild
from torchfleet.train.models import build_model, build_optimizer

# fp16: this many non-finite losses in a row mean the model diverged, not that
# the scaler's scale needs lowering (each one halved it).
FP16_NONFINITE_LIMIT = 8


def evaluate(fleet: Fleet, dataset, on_batch=None) -> float:
    """Accuracy over the whole validation set, each sample counted once across ranks."""
    model = fleet.strategy.model
    was_training = model.training
    model.eval()
    correct = total = 0
    for inputs, targets in fleet.eval_dataloader(dataset):
        outputs = fleet.predict(inputs)
        if on_batch:
            on_batch()  # the watchdog's heartbeat: a long evaluation is progress too
        if outputs is not None:  # pipeline stages other than the last return None
            correct += (outputs.argmax(1).cpu() == targets).sum().item()
            total += len(targets)
    model.train(was_training)
    counts = fleet.all_reduce(torch.tensor([correct, total], dtype=torch.float64), op="sum")
    return (counts[0] / counts[1]).item() if counts[1] > 0 else float("nan")


def train(cfg: TrainConfig, strategy: str, nproc: int = 1) -> dict:
    """Train the built-in job with `strategy` and return the summary figures.

    `nproc` is read by hogwild only: its workers share this process's memory,
    so it spawns them itself (torchfleet.hogwild) instead of running in them.
    """
    if strategy == "hogwild":
        return train_hogwild(cfg, nproc)
    fleet = Fleet(strategy=strategy, precision=cfg.precision, backend=cfg.backend,
                  grad_accum=cfg.grad_accum, **cfg.strategy_options)
    for note in fleet.notes:
        fleet.print(f"note: {note}")
    if fleet.checkpoint_dir and not cfg.checkpoint_dir:
        # A SageMaker job with checkpoints: they go where SageMaker syncs them to S3,
        # and a restarted (Spot) job resumes from there.
        cfg = dataclasses.replace(cfg, checkpoint_dir=str(fleet.checkpoint_dir), resume=True)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
    train_set = builtin_dataset(cfg.data, "train", cfg.seed, cfg.synthetic_size)
    val_set = builtin_dataset(cfg.data, "val", cfg.seed, cfg.synthetic_size)
    in_shape = tuple(train_set[0][0].shape)
    model = build_model(cfg.model, in_shape, num_classes=10)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    model, optimizer = fleet.setup(model, optimizer)
    loader = fleet.dataloader(train_set, cfg.batch_size, shuffle=True, seed=cfg.seed)
    sampler = loader.batch_sampler
    loss_fn = nn.CrossEntropyLoss()

    step = saved = 0
    # After a restart by torchrun's agent (--max-restarts) the group resumes on its own.
    if cfg.checkpoint_dir and (cfg.resume or cfg.resume_fallback or fleet.env.restart_count > 0):
        step = saved = _resume(fleet, cfg, sampler)
    watchdog = Watchdog(fleet.rank, fleet.world_size, cfg.hang_timeout).start() if cfg.hang_timeout else None
    steps_per_epoch = len(sampler)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    nonfinite_streak = 0
    loss = torch.tensor(float("nan"))
    val_accuracy = float("nan")
    samples = 0
    train_seconds = 0.0
    start = time.perf_counter()
    with report.progress(enabled=cfg.progress and fleet.is_main, total=total_steps, done=step) as bar:
        while step < total_steps:
            epoch = sampler.epoch
            tick = time.perf_counter()
            for inputs, targets in loader:
                loss = fleet.train_step(inputs, targets, loss_fn)
                step += 1
                samples += cfg.batch_size
                if watchdog:
                    watchdog.beat(step)
                nonfinite_streak = _check_finite(fleet, loss, step, faults.maybe_fire(fleet.rank, step),
                                                 nonfinite_streak)
                bar.advance(epoch=epoch + 1, loss=loss.item())
                if cfg.checkpoint_dir and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    saved = _save(fleet, cfg, step, sampler)
                if step >= total_steps:
                    break
            train_seconds += time.perf_counter() - tick
            beat = functools.partial(watchdog.beat, step, "evaluate") if watchdog else None
            val_accuracy = evaluate(fleet, val_set, beat)
            bar.epoch_done(epoch + 1, val_accuracy)
            if cfg.checkpoint_dir and not cfg.checkpoint_every:
                saved = _save(fleet, cfg, step, sampler)
    if cfg.checkpoint_dir and saved != step:
        _save(fleet, cfg, step, sampler)  # the final weights, whatever the interval
    if step == total_steps and val_accuracy != val_accuracy:  # NaN: resumed a run that had finished
        val_accuracy = evaluate(fleet, val_set)
    if watchdog:
        watchdog.stop()
    wall = time.perf_counter() - start

    final_loss = fleet.all_reduce(loss.detach(), op="mean").item()
    result = {
        "strategy": fleet.strategy_name,
        "world_size": fleet.world_size,
        "backend": fleet.strategy.runtime.backend or "none",
        "backend_reason": fleet.backend_reason,
        "precision": cfg.precision,
        "model": cfg.model,
        "data": cfg.data,
        "epochs": cfg.epochs,
        "steps": step,
        "global_batch": cfg.batch_size,
        "final_loss": final_loss,
        "val_accuracy": val_accuracy,
        "samples_per_s": samples / train_seconds if train_seconds else 0.0,
        "wall_s": wall,
    }
    memory = fleet.strategy.memory_report()
    if memory:
        result["memory_per_rank"] = memory
    if hasattr(fleet.strategy, "pipeline_report"):  # a collective: every rank calls it
        result["pipeline"] = fleet.strategy.pipeline_report()
    if fleet.is_main:
        report.summary(result)
        if cfg.json_out:
            outputs.write_text(cfg.json_out, json.dumps(result, indent=2) + "\n", "--json-out")
    if fleet.model_dir:
        fleet.save_model()  # SM_MODEL_DIR/model.pt, uploaded when the job ends
    fleet.close()
    return result


def _check_finite(fleet: Fleet, loss: torch.Tensor, step: int, injected: bool, streak: int) -> int:
    """Stop on a non-finite loss, naming the step and rank; returns the fp16 streak.

    Under fp16 the GradScaler skips a step whose gradients overflow and lowers
    its scale: a non-finite loss there is routine, and only a run of
    FP16_NONFINITE_LIMIT of them in a row stops training.
    """
    finite = not injected and torch.isfinite(loss).item()
    if finite:
        return 0
    value = "nan" if injected else f"{loss.item()}"
    scaler = fleet.strategy.runtime.precision.scaler
    if scaler is None:
        raise TrainingError(f"the loss is {value} at step {step} on rank {fleet.rank}; training stopped"
                            " (lower --lr, or use --precision fp32 if it was bf16)")
    streak += 1
    if streak >= FP16_NONFINITE_LIMIT:
        raise TrainingError(f"the loss has been {value} for {streak} steps in a row up to step {step} on rank"
                            f" {fleet.rank}, though the fp16 scaler skipped each one and lowered its scale to"
                            f" {scaler.get_scale():g}; training stopped (lower --lr, or use --precision bf16 or fp32)")
    return streak


def _save(fleet: Fleet, cfg: TrainConfig, step: int, sampler) -> int:
    fleet.save(checkpoint.step_path(cfg.checkpoint_dir, step), step=step, sampler=sampler.state_dict())
    if fleet.is_main:
        checkpoint.prune(cfg.checkpoint_dir, cfg.keep_checkpoints)
    return step


def _resume(fleet: Fleet, cfg: TrainConfig, sampler) -> int:
    found = checkpoint.newest_good(fleet, cfg.checkpoint_dir, fallback=cfg.resume_fallback)
    if found is None:
        fleet.print(f"note: no checkpoint in {cfg.checkpoint_dir}; starting from the beginning")
        return 0
    path, _ = found
    extra = checkpoint.load(fleet, path, strategy_name=fleet.strategy_name)
    sampler.load_state_dict(extra["sampler"])
    fleet.print(f"resumed from {path} at step {extra['step']}")
    return extra["step"]
