"""How `torchfleet train --strategy hogwild -n 4` starts its workers: the one difference from every other strategy.

The workers must share this process's model (torchfleet/hogwild/runner.py hands its storages over as
they are spawned), so this process builds the model and stays their parent instead of being one of
them. Each worker then runs the same loop as any rank of any strategy (train/loop.py's `run_worker`):
Fleet, the job, the run's services and the result. The workers meet in a Gloo process group of their
own, which carries the run's figures (the losses read every --log-every steps, each rank's phases,
the validation sums) and never a gradient: each worker's optimizer writes straight into the shared
parameters. Worker 0 prints, writes --json-out and --metrics-out, and its result is the run's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from torchfleet.data import check_global_batch
from torchfleet.env import DistEnv
from torchfleet.errors import UsageError
from torchfleet.hogwild import runner
from torchfleet.hogwild.worker import worker_info
from torchfleet.models import gpt_config
from torchfleet.netif import LOOPBACK, free_port
from torchfleet.precision import Precision
from torchfleet.strategies.base import Runtime
from torchfleet.strategy_spec import StrategySpec
from torchfleet.train.datasets import builtin_dataset
from torchfleet.train.models import build_model


def spawn(cfg, spec: StrategySpec, workers: int, run_worker: Callable) -> dict:
    """Train the built-in job on `workers` hogwild workers, each running `run_worker(cfg, spec, env, model)`
    (train/loop.py's, given here so that this module does not import the loop that dispatches to it) on the
    model this process shares with them; return worker 0's result."""
    # Fail on bad options here, before any worker starts.
    cpu = torch.device("cpu")
    spec.build(Runtime(DistEnv(), cpu, Precision(cfg.precision, cpu), None))
    if cfg.checkpoint_dir or cfg.resume:
        raise UsageError(
            "hogwild has no single state to checkpoint (each worker keeps its own optimizer"
            " and updates without locks); drop --checkpoint-dir, or use serial or ddp"
        )
    check_global_batch(cfg.batch_size, workers)
    if cfg.data_path:  # the model below is built for the built-in data sets alone
        raise UsageError(f"hogwild reads the built-in data sets only, not --data {cfg.data!r}; use serial or ddp")
    # The same initial weights as every other strategy: set_up's seed, then the model (the data sets draw from
    # generators of their own, so the train set, read here for its inputs' shape, leaves the seed's stream alone).
    torch.manual_seed(cfg.seed)
    block = gpt_config(cfg.gpt_preset).block_size  # read by --data text only
    train_set = builtin_dataset(cfg.data, "train", cfg.seed, cfg.synthetic_size, block_size=block)
    model = build_model(cfg.model, tuple(train_set[0][0].shape), num_classes=10, gpt_preset=cfg.gpt_preset)
    grouped = dataclasses.replace(spec, grouped=True)  # the figures' process group, settled here for the workers
    done = runner.run(
        _worker,
        model,
        workers,
        args=(cfg, grouped, free_port(LOOPBACK), run_worker),
        sharing_strategy=spec.options.single_process.sharing_strategy,
    )
    return done[0]


def _worker(model: nn.Module, cfg, spec: StrategySpec, port: int, run_worker: Callable) -> dict:
    """One worker: a rank of the workers' group, running the loop every strategy runs on the shared model."""
    info = worker_info()
    assert info is not None  # this runs in a hogwild worker, which has its info
    env = DistEnv(
        rank=info.rank,
        local_rank=info.rank,
        world_size=info.world_size,
        local_world_size=info.world_size,
        master_addr=LOOPBACK,
        master_port=port,
    )
    return run_worker(cfg, spec, env, model)
