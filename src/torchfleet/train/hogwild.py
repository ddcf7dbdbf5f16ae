"""The built-in job on hogwild workers: `torchfleet train --strategy hogwild -n 4`.

The workers share this process's model (torchfleet/hogwild/runner.py runs
them); each has its own optimizer and its share of every global batch, and
this process evaluates the shared model when they finish.
"""

from __future__ import annotations

import json
import time

import torch
from torch import nn

from torchfleet import outputs
from torchfleet.data import check_global_batch
from torchfleet.env import DistEnv
from torchfleet.errors import UsageError
from torchfleet.fleet import Fleet
from torchfleet.hogwild import runner
from torchfleet.hogwild.worker import Hogwild, worker_info
from torchfleet.models import gpt_config
from torchfleet.precision import Precision
from torchfleet.strategies.base import Runtime
from torchfleet.strategies.batchnorm import batchnorm_note
from torchfleet.strategy_spec import StrategySpec
from torchfleet.train import report
from torchfleet.train.datasets import builtin_dataset
from torchfleet.train.models import build_model, build_optimizer
from torchfleet.train.tasks import task_for, validate


def train_hogwild(cfg, spec: StrategySpec, workers: int) -> dict:
    """Train the built-in job on `workers` hogwild workers, each given `spec` as settled here (under torchrun,
    Slurm or mpirun settling refused it); return the summary figures."""
    # Fail on bad options here, before any worker starts.
    cpu = torch.device("cpu")
    spec.build(Runtime(DistEnv(), cpu, Precision(cfg.precision, cpu), None))
    if cfg.checkpoint_dir or cfg.resume:
        raise UsageError(
            "hogwild has no single state to checkpoint (each worker keeps its own optimizer"
            " and updates without locks); drop --checkpoint-dir, or use serial or ddp"
        )
    if cfg.metrics_out or cfg.tensorboard:
        raise UsageError(
            "hogwild's workers keep no common record of their steps to log; drop --metrics-out"
            " and --tensorboard, or use serial or ddp"
        )
    check_global_batch(cfg.batch_size, workers)
    if cfg.data_path:  # the job below is built from the built-in data sets alone
        raise UsageError(f"hogwild reads the built-in data sets only, not --data {cfg.data!r}; use serial or ddp")

    torch.manual_seed(cfg.seed)  # the same initial weights as every other strategy
    block = gpt_config(cfg.gpt_preset).block_size  # read by --data text only
    train_set = builtin_dataset(cfg.data, "train", cfg.seed, cfg.synthetic_size, block_size=block)
    val_set = builtin_dataset(cfg.data, "val", cfg.seed, cfg.synthetic_size, block_size=block)
    model = build_model(cfg.model, tuple(train_set[0][0].shape), num_classes=10, gpt_preset=cfg.gpt_preset)
    note = batchnorm_note(model, Hogwild.name, synced=False)  # said here once, not by every worker
    if note:
        print(f"note: {note}", flush=True)
    start = time.perf_counter()
    done = runner.run(
        _train_worker,
        model,
        workers,
        args=(cfg, spec, train_set, val_set),
        sharing_strategy=spec.options.single_process.sharing_strategy,
    )
    wall = time.perf_counter() - start
    train_seconds = max(d["seconds"] for d in done)
    result = {
        "strategy": Hogwild.name,
        "world_size": workers,
        "backend": "none",
        "backend_reason": "no process group: the workers share the model's memory",
        "precision": cfg.precision,
        "model": cfg.model,
        "data": cfg.data,
        "epochs": cfg.epochs,
        "steps": done[0]["steps"],
        "global_batch": cfg.batch_size,
        "final_loss": sum(d["loss"] for d in done) / workers,
        **validate(model, val_set, task_for(cfg.model)),
        "samples_per_s": sum(d["samples"] for d in done) / train_seconds if train_seconds else 0.0,
        "wall_s": wall,
    }
    report.summary(result)
    if cfg.json_out:
        outputs.write_text(cfg.json_out, json.dumps(result, indent=2) + "\n", "--json-out")
    return result


def _train_worker(model: nn.Module, cfg, spec: StrategySpec, train_set, val_set) -> dict:
    """One worker's loop: its own optimizer, its share of each global batch, no locks."""
    info = worker_info()
    assert info is not None  # this runs in a hogwild worker, which has its info
    fleet = Fleet(strategy=spec.name, settled=spec, precision=cfg.precision, grad_accum=cfg.grad_accum)
    torch.manual_seed(cfg.seed + info.rank)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    model, optimizer = fleet.setup(model, optimizer)
    loader = fleet.dataloader(train_set, cfg.batch_size, shuffle=True, seed=cfg.seed)
    total_steps = len(loader) * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    task = task_for(cfg.model)
    step = samples = 0
    loss = torch.tensor(float("nan"))
    tick = time.perf_counter()
    evaluating = 0.0  # worker 0's validation passes, kept out of the training time
    for epoch in range(cfg.epochs):
        for inputs, targets in loader:
            loss = fleet.train_step(inputs, targets, task.loss_fn)
            step += 1
            samples += len(inputs)
            if step >= total_steps:
                break
        if info.rank == 0 and cfg.progress:
            # Worker 0's view while the others may still be writing: that is hogwild.
            began = time.perf_counter()
            print(f"epoch {epoch + 1}: {report.describe(validate(model, val_set, task))}", flush=True)
            evaluating += time.perf_counter() - began
        if step >= total_steps:
            break
    return {"steps": step, "samples": samples, "loss": loss.item(), "seconds": time.perf_counter() - tick - evaluating}
