"""Fleet: the one object a training script holds.

It reads the environment once (`DistEnv.detect()`), picks the backend and
says why, starts the process group when there is more than one process, and
hands the model to the chosen strategy. The same script therefore runs under
``python``, ``torchfleet run``, ``torchrun``, Slurm or mpirun unchanged.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, TensorDataset

from torchfleet import checkpoint
from torchfleet.backend import choose_backend, probe_hardware
from torchfleet.data import GlobalBatchSampler, ShardSampler, TensorBatches, as_batch
from torchfleet.env import DistEnv
from torchfleet.errors import UsageError
from torchfleet.precision import Precision
from torchfleet.strategies import Runtime, get_strategy
from torchfleet.strategies.base import LossFn

# How long a collective may wait before the process group gives up. Long
# enough for a slow first step; issue-level hang detection is the watchdog's job.
_PG_TIMEOUT = datetime.timedelta(minutes=10)


class Fleet:
    def __init__(
        self,
        strategy: str = "serial",
        precision: str = "fp32",
        backend: str = "auto",
        grad_accum: int = 1,
        env: DistEnv | None = None,
        **strategy_options: Any,
    ):
        if grad_accum < 1:
            raise UsageError(f"grad_accum {grad_accum} must be at least 1")
        strategy_cls = get_strategy(strategy)
        self.env = env or DistEnv.detect()
        self.grad_accum = grad_accum
        self.notes: list[str] = []

        hardware = probe_hardware()
        self.backend, self.backend_reason = choose_backend(hardware, backend)
        if strategy_cls.distributed and not self.env.is_distributed:
            self.notes.append(f"{strategy} with one process has nothing to share; running it as serial")
            strategy_cls = get_strategy("serial")
            strategy_options = {}
        if self.env.is_distributed and not strategy_cls.distributed:
            raise UsageError(
                f"strategy {strategy!r} runs in one process but {self.env.world_size} were started;"
                f" use -n 1, or a multi-process strategy such as ddp"
            )
        self.device = self._pick_device()
        if self.env.is_distributed:
            self._init_process_group()
        self.strategy = strategy_cls(
            Runtime(self.env, self.device, Precision(precision, self.device),
                    self.backend if self.env.is_distributed else None),
            **strategy_options,
        )

    # -- set-up -----------------------------------------------------------
    def _pick_device(self) -> torch.device:
        if self.backend == "nccl" or (torch.cuda.is_available() and not self.env.is_distributed):
            index = self.env.local_rank % max(1, torch.cuda.device_count())
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            return
        env = self.env
        if env.source == "torchrun":
            # torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT.
            init_method = "env://"
        else:
            init_method = f"tcp://{env.master_addr}:{env.master_port}"
        dist.init_process_group(
            self.backend, init_method=init_method, rank=env.rank,
            world_size=env.world_size, timeout=_PG_TIMEOUT,
        )

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """Wrap `model` and `optimizer` for the strategy; use what it returns."""
        return self.strategy.wrap(model, optimizer)

    def dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = True, seed: int = 0,
                   drop_last: bool = True, num_workers: int = 0) -> DataLoader:
        """A loader of this rank's share of each global batch of `batch_size` samples."""
        rank, world = self.strategy.data_coords()
        sampler = GlobalBatchSampler(len(dataset), batch_size, rank, world, shuffle, seed, drop_last)
        if sampler.local_batch % self.grad_accum:
            raise UsageError(
                f"each process's batch of {sampler.local_batch} (batch size {batch_size} / {world}"
                f" processes) does not split into {self.grad_accum} accumulation steps;"
                f" use a batch size that is a multiple of {world * self.grad_accum}"
            )
        if type(dataset) is TensorDataset:
            # In-memory tensors: gather each batch at once instead of sample by sample.
            return DataLoader(TensorBatches(dataset), batch_sampler=sampler, num_workers=num_workers,
                              collate_fn=as_batch)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers)

    def eval_dataloader(self, dataset: Dataset, batch_size: int = 256) -> DataLoader:
        """Every sample exactly once across ranks; combine results with `all_reduce`."""
        rank, world = self.strategy.data_coords()
        return DataLoader(dataset, batch_size=batch_size, sampler=ShardSampler(len(dataset), rank, world))

    # -- training ---------------------------------------------------------
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """Forward, backward and optimizer step for one global batch; returns this rank's loss."""
        inputs, targets = self.to_device(inputs), self.to_device(targets)
        return self.strategy.train_step(inputs, targets, loss_fn, self.grad_accum)

    def backward(self, loss: torch.Tensor) -> None:
        """For hand-written loops: backward with the precision's loss scaling."""
        self.strategy.runtime.precision.backward(loss)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """For hand-written loops: optimizer step (through the fp16 scaler when there is one)."""
        self.strategy.runtime.precision.step(optimizer)

    def autocast(self):
        """For hand-written loops: the forward's mixed-precision context."""
        return self.strategy.runtime.precision.autocast()

    def no_sync(self):
        """For hand-written accumulation: backward inside skips the gradient all-reduce."""
        return self.strategy.no_sync()

    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.strategy.predict(self.to_device(inputs))

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    # -- collectives and printing -------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def strategy_name(self) -> str:
        return self.strategy.name

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """Combine a metric over all ranks: op is "mean", "sum", "max" or "min"."""
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise UsageError(f"unknown reduction {op!r}; choose one of {', '.join(ops)}")
        tensor = torch.as_tensor(value, dtype=torch.float64, device=self.device).clone()
        if dist.is_initialized():
            dist.all_reduce(tensor, ops[op])
            if op == "mean":
                tensor /= self.world_size
        return tensor

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main rank only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- checkpoints ------------------------------------------------------
    def save(self, path: str | os.PathLike, **extra: Any) -> None:
        """Save model, optimizer, scaler and `extra` atomically (main rank writes)."""
        checkpoint.save(self, path, extra)

    def load(self, path: str | os.PathLike) -> dict:
        """Load what `save` wrote into the wrapped model and optimizer; returns `extra`."""
        return checkpoint.load(self, path)

    def close(self) -> None:
        """Leave the process group (a no-op for one process).

        All ranks meet at a barrier first: a rank that tears down its Gloo
        pairs while a peer still uses them can abort at exit.
        """
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
