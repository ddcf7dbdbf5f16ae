"""The one training loop behind `torchfleet train`, for every strategy.

It runs inside each worker process (or the only process): the launcher has
already started the processes, and Fleet has joined them into a group.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import torch

from torchfleet import checkpoint, outputs
from torchfleet.data import GlobalBatchSampler
from torchfleet.fleet import Fleet
from torchfleet.hogwild.command import train_hogwild
from torchfleet.models import gpt_config
from torchfleet.train import faults, report
from torchfleet.train.config import TrainConfig
from torchfleet.train.datasets import builtin_dataset
from torchfleet.train.losses import FP16_NONFINITE_LIMIT, LossWindow  # noqa: F401 - the limit stays importable from here
from torchfleet.train.metrics import MetricsLog
from torchfleet.train.models import build_model, build_optimizer
from torchfleet.train.tasks import CLASSIFY, Task, task_for
from torchfleet.worker import preemption
from torchfleet.worker.hang_watchdog import Watchdog


def evaluate(fleet: Fleet, dataset, on_batch=None, task: Task = CLASSIFY) -> dict:
    """`task`'s validation figures over the whole validation set, each sample counted once
    across ranks: {"val_accuracy": ...}, or val_loss and val_perplexity for gpt (train/tasks.py)."""
    model = fleet.strategy.model
    was_training = model.training
    model.eval()
    numerator = count = 0.0
    for inputs, targets in fleet.eval_dataloader(dataset):
        outputs = fleet.predict(inputs)
        if on_batch:
            on_batch()  # the watchdog's heartbeat: a long evaluation is progress too
        if outputs is not None:  # pipeline stages other than the last return None
            n, c = task.tally(outputs, targets)
            numerator, count = numerator + n, count + c
    model.train(was_training)
    sums = fleet.all_reduce(torch.tensor([numerator, count], dtype=torch.float64), op="sum")
    return task.figures(sums[0].item(), sums[1].item())


def train(cfg: TrainConfig, strategy: str, nproc: int = 1) -> dict:
    """Train the built-in job with `strategy` and return the summary figures.

    `nproc` is read by hogwild only: its workers share this process's memory,
    so it spawns them itself (torchfleet.hogwild) instead of running in them.
    """
    if strategy == "hogwild":
        return train_hogwild(cfg, nproc)
    fleet = Fleet(strategy=strategy, precision=cfg.precision, backend=cfg.backend,
                  grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm,
                  activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                  **cfg.strategy_options)
    if fleet.checkpoint_dir and not cfg.checkpoint_dir:
        # A SageMaker job with checkpoints: they go where SageMaker syncs them to S3,
        # and a restarted (Spot) job resumes from there.
        cfg = dataclasses.replace(cfg, checkpoint_dir=str(fleet.checkpoint_dir), resume=True)
    if cfg.checkpoint_dir and fleet.replicas is not None and fleet.replicas.own_checkpoints:
        # diloco, localsgd: each group's weights and inner optimizer are its own between meetings.
        cfg = dataclasses.replace(cfg, checkpoint_dir=os.path.join(cfg.checkpoint_dir,
                                                                   f"group{fleet.replicas.env.group}"))
    # Once the checkpoint directory is known (SageMaker's spot jobs get one here), before the model
    # is built: a signal during setup is acted on after the first step. Without a directory there
    # is nothing to save, and a signal must end the job as it always did, not be swallowed.
    with preemption.listening(cfg.preempt_signals if cfg.checkpoint_dir else None,
                           cfg.preempt_notice if cfg.checkpoint_dir else None,
                           watch=fleet.env.local_rank == 0) as listener:
        return _train(cfg, fleet, listener)


@dataclasses.dataclass
class _Job:
    """The built-in job, set up by Fleet: what the loop trains and evaluates."""

    optimizer: torch.optim.Optimizer
    task: Task
    loader: torch.utils.data.DataLoader
    sampler: GlobalBatchSampler
    val_set: torch.utils.data.Dataset
    block: int  # a gpt sample's tokens


def _set_up(cfg: TrainConfig, fleet: Fleet) -> _Job:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
    block = gpt_config(cfg.gpt_preset).block_size  # read by --data text only
    assert cfg.data is not None  # TrainConfig.__post_init__ puts the model's default there
    train_set = builtin_dataset(cfg.data, "train", cfg.seed, cfg.synthetic_size, block_size=block)
    val_set = builtin_dataset(cfg.data, "val", cfg.seed, cfg.synthetic_size, block_size=block)
    in_shape = tuple(train_set[0][0].shape)
    model = build_model(cfg.model, in_shape, num_classes=10, gpt_preset=cfg.gpt_preset)
    task = task_for(cfg.model)  # the loss, and what validation reports
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    loader = fleet.dataloader(train_set, cfg.batch_size, shuffle=True, seed=cfg.seed)
    sampler = loader.batch_sampler
    assert isinstance(sampler, GlobalBatchSampler)  # fleet.dataloader's own: local_batch, epoch, state
    # A batch of this rank's shape, for pipelines that trace the model to cut it. Made from
    # the data set, not the loader: a loader's iterator draws from its shuffling generator.
    example = torch.stack([train_set[i][0] for i in range(sampler.local_batch)])
    _, optimizer = fleet.setup(model, optimizer, example_inputs=example)
    for note in fleet.notes:  # after setup: the BatchNorm note needs the model
        fleet.print(f"note: {note}")
    return _Job(optimizer, task, loader, sampler, val_set, block)


def _train(cfg: TrainConfig, fleet: Fleet, listener: preemption.Listener) -> dict:
    job = _set_up(cfg, fleet)
    optimizer, task, loader, sampler, val_set = job.optimizer, job.task, job.loader, job.sampler, job.val_set
    loss_fn = task.loss_fn

    step = saved = 0
    replicas = fleet.replicas  # under --fault-tolerance step: this machine's replica group
    # After a restart by torchrun's agent (--max-restarts) the group resumes on its own; a replica group
    # heals from a live peer instead, which is ahead of any checkpoint.
    restarted = fleet.env.restart_count > 0 and replicas is None
    loss = torch.tensor(float("nan"))  # the newest step's; a resumed run starts with its checkpoint's
    if cfg.checkpoint_dir and (cfg.resume or cfg.resume_fallback or restarted):
        step, saved_loss = _resume(fleet, cfg, sampler)
        saved = step
        if saved_loss is not None:
            loss = torch.tensor(saved_loss)
    watchdog = Watchdog(fleet.rank, fleet.world_size, cfg.hang_timeout).start() if cfg.hang_timeout else None
    steps_per_epoch = len(sampler)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    # The loss reaches the host every --log-every steps, not every step (train/losses.py).
    window = LossWindow(cfg.log_every, fleet.rank, fleet.strategy.runtime.precision.scaler, fleet.all_reduce)
    # The validation figures' names (a tally of nothing gives them) are the file's columns.
    metrics = MetricsLog(cfg.metrics_out, cfg.tensorboard, tuple(task.figures(0.0, 0.0)), start_step=step,
                         extras=("participants",) if replicas else ()) if fleet.is_main else MetricsLog()
    val = {}  # the newest validation figures (evaluate's)
    samples = 0
    train_seconds = 0.0
    start = time.perf_counter()

    def leave_if_asked() -> None:
        """After a step or an epoch's read: when told to leave, save (unless just saved) and go.
        One process acts on its own flag at once; many act on the flag their last read agreed on
        (LossWindow.read), at most --log-every steps after the signal, all at the same step."""
        if not (listener.requested if fleet.world_size == 1 else window.leave):
            return
        nonlocal saved
        if saved != step:
            if fleet.world_size == 1:  # the read that checks the losses: never a diverged checkpoint
                _log(window, metrics, step, sampler.epoch + 1, optimizer, samples, listener.requested)
            saved = _save(fleet, cfg, step, sampler, loss)
        if watchdog:
            watchdog.stop()
        assert cfg.checkpoint_dir is not None  # listening only with --checkpoint-dir
        raise preemption.leave(listener, fleet.env.local_rank, fleet.is_main, step,
                            checkpoint.step_path(cfg.checkpoint_dir, step))

    def groups() -> dict:  # the replica groups in the step's quorum, for the bar and the metrics
        return {"participants": replicas.participants} if replicas else {}

    with report.progress(enabled=cfg.progress and fleet.is_main, total=total_steps, done=step,
                         groups=replicas is not None) as bar, metrics:
        while step < total_steps:
            epoch = sampler.epoch
            tick = time.perf_counter()
            moved = False
            for inputs, targets in loader:
                loss = fleet.train_step(inputs, targets, loss_fn)
                if replicas is not None and replicas.step != step + 1:
                    # torchft's count: a step that did not commit is done again on the same batch, and a
                    # group that healed goes on at its peers' step; Fleet has moved the loader to its batch
                    # (step k reads batch k, everywhere). At another epoch, that epoch's pass starts there.
                    step = replicas.step
                    if watchdog:
                        watchdog.beat(step)
                    bar.at(step)
                    if sampler.epoch != epoch:
                        moved = True
                        break
                    continue
                step += 1
                samples += cfg.batch_size
                if watchdog:
                    watchdog.beat(step)
                window.add(loss, step, injected=faults.maybe_fire(fleet.rank, step))
                saving = cfg.checkpoint_dir and cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                shown = None
                if step % cfg.log_every == 0 or saving:  # read before saving: never a diverged checkpoint
                    shown = _log(window, metrics, step, epoch + 1, optimizer, samples, listener.requested,
                                 **groups())
                bar.advance(epoch=epoch + 1, loss=shown, groups=f"{replicas.participants}/{replicas.env.groups}"
                            if replicas else None)
                if saving:
                    saved = _save(fleet, cfg, step, sampler, loss)
                leave_if_asked()
                if step >= total_steps:
                    break
            if moved:
                train_seconds += time.perf_counter() - tick
                continue  # the loader starts again at the step's batch
            bar.advance(epoch=epoch + 1, loss=_log(window, metrics, step, epoch + 1, optimizer, samples,
                                                   listener.requested, **groups()), steps=0)
            leave_if_asked()  # before the evaluation, which the time left may not allow
            if step >= total_steps:
                fleet.finish()  # diloco and localsgd: the groups' last meeting, before the final evaluation
            train_seconds += time.perf_counter() - tick  # after the read: the GPU has finished the epoch
            beat = functools.partial(watchdog.beat, step, "evaluate") if watchdog else None
            val = evaluate(fleet, val_set, beat, task)
            bar.epoch_done(epoch + 1, val)
            metrics.epoch(step, epoch + 1, val)
            if cfg.checkpoint_dir and not cfg.checkpoint_every:
                saved = _save(fleet, cfg, step, sampler, loss)
    if cfg.checkpoint_dir and saved != step:
        _save(fleet, cfg, step, sampler, loss)  # the final weights, whatever the interval
    if step == total_steps and not val:  # resumed a run that had finished: no epoch ran
        fleet.print(f"note: the checkpoint is at the run's last step ({step}): nothing is left to train, and the"
                    " final loss is the checkpoint's")
        val = evaluate(fleet, val_set, task=task)
    if watchdog:
        watchdog.stop()
    wall = time.perf_counter() - start

    return _finish(cfg, fleet, job, step, loss, val, samples, train_seconds, wall)


def _finish(cfg: TrainConfig, fleet: Fleet, job: _Job, step: int, loss: torch.Tensor, val: dict, samples: int,
            train_seconds: float, wall: float) -> dict:
    """The run's figures: printed, written to --json-out, the model saved where asked; the group closed."""
    replicas, task = fleet.replicas, job.task
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
        **val,
        "wall_s": wall,
    }
    if samples and train_seconds:  # a run resumed at its last step trained nothing, and has no rate to give
        result["samples_per_s"] = samples / train_seconds
        if task is not CLASSIFY:  # a sample is a sequence of `block` tokens
            result["tokens_per_s"] = result["samples_per_s"] * job.block
    if task is not CLASSIFY:
        result["gpt_preset"] = cfg.gpt_preset
    if replicas is not None:
        result.update(replica_group=replicas.env.group, replica_groups=replicas.participants,
                      replica_pauses_s=[round(p, 2) for p in replicas.account.pauses])
    memory = fleet.strategy.memory_report()
    if memory:
        result["memory_per_rank"] = memory
    pipeline_report = getattr(fleet.strategy, "pipeline_report", None)  # pipelines' only
    if pipeline_report is not None:  # a collective: every rank calls it
        result["pipeline"] = pipeline_report()
    if fleet.is_main:
        report.summary(result)
        if cfg.json_out:
            outputs.write_text(cfg.json_out, json.dumps(result, indent=2) + "\n", "--json-out")
    if cfg.save_model:
        fleet.save_model(cfg.save_model)
    if fleet.model_dir:
        fleet.save_model()  # SM_MODEL_DIR/model.pt, uploaded when the job ends
    fleet.close()
    return result


def _log(window: LossWindow, metrics: MetricsLog, step: int, epoch: int, optimizer, samples: int,
         leave: bool = False, **extras: float) -> float | None:
    """Read the loss window (the host sync of a log interval) and record its mean; None if it was empty.
    `leave`, this rank's preemption flag, is agreed on in the same read (window.leave)."""
    loss = window.read(leave)
    if loss is not None:
        metrics.step(step, epoch, loss, optimizer.param_groups[0]["lr"], samples, **extras)
    return loss


def _save(fleet: Fleet, cfg: TrainConfig, step: int, sampler, loss: torch.Tensor) -> int:
    """Checkpoint `step` with the loader's position and the step's loss (the mean over the ranks, as the summary
    gives it), which a run resumed at its last step reports as its final loss."""
    assert cfg.checkpoint_dir is not None  # called only with --checkpoint-dir
    final_loss = fleet.all_reduce(loss.detach(), op="mean").item()
    fleet.save(checkpoint.step_path(cfg.checkpoint_dir, step), step=step, sampler=sampler.state_dict(),
               final_loss=final_loss)
    if fleet.is_main and fleet.writes_checkpoints:  # replica groups: the group that wrote it
        checkpoint.prune(cfg.checkpoint_dir, cfg.keep_checkpoints)
    return step


def _resume(fleet: Fleet, cfg: TrainConfig, sampler) -> tuple[int, float | None]:
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
    moved = "" if saved_by == (fleet.strategy_name, fleet.world_size) else (
        f", saved by {saved_by[0]} on {_processes(saved_by[1])} and resharded for {fleet.strategy_name} on"
        f" {_processes(fleet.world_size)}")
    fleet.print(f"resumed from {path} at step {extra['step']}{moved}")
    return extra["step"], extra.get("final_loss")  # older checkpoints hold no loss


def _processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")
