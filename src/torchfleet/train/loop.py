"""The one training loop behind `torchfleet train`, for every strategy.

It runs inside each worker process (or the only process): the launcher has
already started the processes, and Fleet has joined them into a group.
train/job.py sets the job up; train/run_state.py holds where the run stands
and what happens after each step and epoch, so the loop below reads top to
bottom.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from torch import nn

from torchfleet import outputs
from torchfleet.env import DistEnv
from torchfleet.fleet import Fleet
from torchfleet.strategy_spec import StrategySpec, settle
from torchfleet.train import hogwild, report
from torchfleet.train.config import TrainConfig
from torchfleet.train.job import Job, set_up
from torchfleet.train.run_state import Run
from torchfleet.train.tasks import CLASSIFY
from torchfleet.worker import preemption


def train(cfg: TrainConfig, strategy: str | StrategySpec, nproc: int = 1) -> dict:
    """Train the built-in job with `strategy` and return the summary figures.

    `strategy`: the spec the launcher settled, or a name this process settles
    with `cfg.strategy_options` (it read the user's words itself).
    `nproc` is read by hogwild only: its workers share this process's memory,
    so it spawns them itself (train/hogwild.py), each running `run_worker`.
    """
    spec = (
        strategy
        if isinstance(strategy, StrategySpec)
        else settle(strategy, cfg.strategy_options, DistEnv.detect(), None)
    )
    if spec.preset.launch == "spawn":  # hogwild: its own start, then this loop in every worker
        return hogwild.spawn(cfg, spec, nproc, run_worker)
    return run_worker(cfg, spec)


def run_worker(
    cfg: TrainConfig, spec: StrategySpec, env: DistEnv | None = None, model: nn.Module | None = None
) -> dict:
    """One rank's run of the built-in job, the same for every strategy: Fleet, the job, the loop, the result.

    `env`: this rank's place where its launcher gave none in the environment (a hogwild worker's);
    `model`: the model to train instead of the job's own (the one hogwild's workers share)."""
    fleet = Fleet(
        strategy=spec.name,
        settled=spec,
        env=env,
        precision=cfg.precision,
        backend=cfg.backend,
        grad_accum=cfg.grad_accum,
        max_grad_norm=cfg.max_grad_norm,
        activation_checkpointing=cfg.activation_checkpointing,
        compile=cfg.compile,
    )
    fleet.run_options = None  # train's Run serves the ranks itself (the same run_services), from its loss reads
    if fleet.checkpoint_dir and not cfg.checkpoint_dir:
        # A SageMaker job with checkpoints: they go where SageMaker syncs them to S3,
        # and a restarted (Spot) job resumes from there.
        cfg = dataclasses.replace(cfg, checkpoint_dir=str(fleet.checkpoint_dir), resume=True)
    if cfg.checkpoint_dir and fleet.replicas is not None and fleet.replicas.own_checkpoints:
        # diloco, localsgd: each group's weights and inner optimizer are its own between meetings.
        cfg = dataclasses.replace(
            cfg, checkpoint_dir=os.path.join(cfg.checkpoint_dir, f"group{fleet.replicas.env.group}")
        )
    # Once the checkpoint directory is known (SageMaker's spot jobs get one here), before the model
    # is built: a signal during setup is acted on after the first step. Without a directory there
    # is nothing to save, and a signal must end the job as it always did, not be swallowed.
    with preemption.listening(
        cfg.preempt_signals if cfg.checkpoint_dir else None,
        cfg.preempt_notice if cfg.checkpoint_dir else None,
        watch=fleet.env.local_rank == 0,
    ) as listener:
        return _train(cfg, fleet, listener, model)


def _train(cfg: TrainConfig, fleet: Fleet, listener: preemption.Listener, model: nn.Module | None) -> dict:
    job = set_up(cfg, fleet, model)
    run = Run(cfg, fleet, job, listener)  # at step 0, or at the checkpoint's step when resuming
    with run.shown():
        while not run.done:
            epoch, tick = job.sampler.epoch, time.perf_counter()
            moved = False  # a replica group healed into another epoch: its pass starts at the peers' batch
            for inputs, targets in run.batches():  # each fetch timed
                run.loss = fleet.train_step(inputs, targets, job.task.loss_fn)
                run.clock.trained()
                if run.took_peers_step():  # torchft redid the step, or the group healed to its peers'
                    moved = job.sampler.epoch != epoch
                    if moved:
                        break
                    continue
                run.stepped(epoch)  # logged, checkpointed, left when told to, as the flags say
                if run.done:
                    break
            if not moved:
                run.epoch_read(epoch)
            run.train_seconds += time.perf_counter() - tick  # after the read: the GPU has finished the epoch
            if not moved:
                run.evaluated(epoch)
    wall = run.ended()
    return _finish(cfg, fleet, job, run, wall)


def _finish(cfg: TrainConfig, fleet: Fleet, job: Job, run: Run, wall: float) -> dict:
    """The run's figures: printed, written to --json-out, the model saved where asked; the group closed."""
    replicas, task = fleet.replicas, job.task
    final_loss = fleet.all_reduce(run.loss.detach(), op="mean").item()
    result = {
        "strategy": fleet.strategy_name,
        "world_size": fleet.world_size,
        "backend": fleet.strategy.runtime.backend or "none",
        "backend_reason": fleet.backend_reason,
        "precision": cfg.precision,
        "model": cfg.hf_model or cfg.model,
        "data": cfg.data,
        "epochs": cfg.epochs,
        "steps": run.step,
        "global_batch": cfg.batch_size,
        "final_loss": final_loss,
        **run.val,
        "wall_s": wall,
    }
    if run.samples and run.train_seconds:  # a run resumed at its last step trained nothing, and has no rate to give
        result["samples_per_s"] = run.samples / run.train_seconds
        if task is not CLASSIFY:  # a sample is a sequence of `block` tokens
            result["tokens_per_s"] = result["samples_per_s"] * job.block
    if task is not CLASSIFY:
        result["gpt_preset"] = cfg.gpt_preset
    if replicas is not None:
        result.update(
            replica_group=replicas.env.group,
            replica_groups=replicas.participants,
            replica_pauses_s=[round(p, 2) for p in replicas.account.pauses],
        )
    # A collective: every rank calls it (each has the same model, with experts or without).
    load = job.expert_load.shares(fleet.strategy.runtime.device) if job.expert_load else None
    if load:
        result["expert_load"] = load
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
