"""Fleet: the one object a training script holds.

It reads the environment once (`DistEnv.detect()`), picks the backend and
says why, starts the process group when there is more than one process (or
a launcher started one for ddp or fsdp), and hands the model to the chosen
strategy. The same script therefore runs under ``python``, ``torchfleet
run``, ``torchrun``, Slurm, mpirun, a SageMaker training job or a Kubeflow
PyTorchJob unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from torchfleet import allocator, checkpoint, memory_format, versions
from torchfleet.backend import choose_backend, probe_hardware, shared_gpus_refusal, shares_gpus
from torchfleet.data import Collate, GlobalBatchSampler, ShardSampler, batch_loader, check_accumulation, dataset_length
from torchfleet.data.stream import StreamLoader, is_stream, stream_loader
from torchfleet.env import DistEnv
from torchfleet.env.process_group import join_process_group
from torchfleet.env.sagemaker import TrainingEnv
from torchfleet.errors import UsageError
from torchfleet.launcher.sagemaker import relaunch_per_gpu
from torchfleet.precision import Precision
from torchfleet.replica_groups import which_group
from torchfleet.run_services import in_fleet
from torchfleet.strategies import Runtime, registry
from torchfleet.strategies.base import Batch, LossFn, SetupArgs
from torchfleet.strategies.batchnorm import batchnorm_note
from torchfleet.strategies.block_transforms import COMPILE_MODES, adopt_late_compile, unwrap_compiled
from torchfleet.strategies.expert_load import ExpertLoad
from torchfleet.strategy_spec import StrategySpec, settle
from torchfleet.weights import Pretrained, Start, saving
from torchfleet.worker import preemption


class Fleet:
    expert_load: ExpertLoad | None = None  # tokens per expert of a model with experts: its shares() and close()'s line

    def __init__(
        self,
        strategy: str = registry.REFERENCE,
        precision: str = "fp32",
        backend: str = "auto",
        grad_accum: int = 1,
        env: DistEnv | None = None,
        max_grad_norm: float | None = None,
        activation_checkpointing: bool = False,
        compile: bool | str = False,
        channels_last: bool | None = None,
        fault_tolerance: str | None = None,
        preempt_signals: str | None = None,
        preempt_notice: str | None = None,
        settled: StrategySpec | None = None,
        **strategy_options: Any,
    ):
        """`max_grad_norm`: clip gradients to this global norm (over every shard and stage).
        `activation_checkpointing`: recompute each repeated block's activations in backward.
        `compile`: torch.compile each block in place (True or "blocks") or the whole model ("model").
        `channels_last`: NHWC convolution weights and image batches (None: on for a model with convolutions
        in bf16 or fp16 on a GPU, as cuDNN's fast kernels want; memory_format.py).
        `fault_tolerance`: "step" in a replica group (`torchfleet run --fault-tolerance step` makes them; None:
        as the launcher says), "restart" otherwise. diloco and localsgd take `sync_every`, `outer_lr`... too.
        `preempt_signals` ("TERM,USR1"), `preempt_notice` ("aws", a URL...): what preempted() listens for
        (default: what `torchfleet run --preempt-signals/--preempt-notice` said, else TERM,USR1 and no notice).
        `settled`: a spec `torchfleet train`'s launcher settled (strategy, options, fault_tolerance unread)."""
        versions.require_supported_torch()
        if grad_accum < 1:
            raise UsageError(f"grad_accum {grad_accum} must be at least 1")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise UsageError(f"max_grad_norm {max_grad_norm} must be a positive number")
        if compile not in (False, True, *COMPILE_MODES):
            raise UsageError(f'compile {compile!r} is not a mode; use True, "blocks" or "model"')
        self.activation_checkpointing, self.compile = activation_checkpointing, compile
        self._channels_last_asked, self.channels_last = channels_last, False  # settled by setup, seeing the model
        self.env = env or DistEnv.detect()
        spec = settled or settle(strategy, strategy_options, self.env, fault_tolerance)  # what the name comes to
        self.sagemaker = TrainingEnv.read()  # None outside a SageMaker training job
        # Ranks from SM_* alone (not torchrun's or mpirun's) on a multi-GPU host: the toolkit
        # started this one process, so it starts one worker per GPU and exits here.
        if self.env.source == "sagemaker" and self.sagemaker is not None and self.sagemaker.needs_per_gpu_launch():
            relaunch_per_gpu(self.env)
        self.grad_accum = grad_accum
        self._leaving = preemption.Leaving(preempt_signals, preempt_notice)
        self.notes: list[str] = list(spec.notes)
        self._samplers: list[GlobalBatchSampler] = []  # the training loaders' (dataloader)
        self._returned: torch.nn.Module | None = None  # what setup returned, until train_step's first check
        self._pretrained: Pretrained | None = None  # a transformers model's config and keys, for save_model
        self.weights_report: dict | None = None  # setup's: bytes read and mapped of `weights`, what it initialised
        self.run_options, self.services = in_fleet.RunOptions.from_environment(), None  # run_services/in_fleet.py

        hardware = probe_hardware()
        local_procs = self.env.local_world_size if self.env.is_distributed else 1
        self.backend, self.backend_reason = choose_backend(hardware, backend, local_procs)
        # More processes than GPUs here, and Gloo chosen for it: the processes share the GPUs.
        self._gpus_shared = (
            backend.strip().lower() == "auto" and self.backend == "gloo" and shares_gpus(hardware, local_procs)
        )
        self.device = torch.device("cpu") if spec.cls.cpu_only else self._pick_device()
        if self.device.type == "cpu":
            allocator.keep_freed_memory()  # a step's memory stays for the next step
        if spec.grouped:
            join_process_group(self.env, self.backend)
        self.replicas = which_group.group(spec.joined, self.env, self.device)  # per_step.py or outer_step.py
        runtime = Runtime(
            self.env,
            self.device,
            Precision(precision, self.device),
            self.backend if spec.grouped else None,
            max_grad_norm,
            self.replicas,
        )
        self.strategy = spec.build(runtime)
        if self._gpus_shared and not registry.shares_gpus(self.strategy.name):  # the name its degrees make
            raise UsageError(shared_gpus_refusal(self.strategy.name, local_procs, hardware.gpus))
        if spec.joined.meeting is not None:
            self.strategy.name = spec.joined.meeting.method  # what checkpoints and reports call it
            self.notes.append(spec.joined.meeting.describe())
        self.notes.extend(self.strategy.notes)

    # -- set-up -----------------------------------------------------------
    def _pick_device(self) -> torch.device:
        if self.backend == "nccl" or self._gpus_shared or (torch.cuda.is_available() and not self.env.is_distributed):
            index = self.env.local_rank % max(1, torch.cuda.device_count())
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def init_module(self):
        """A context that builds a model without its memory (meta device); setup gives each process its share."""
        return torch.device("meta")

    def setup(
        self, model, optimizer, example_inputs=None, weights: Path | str | None = None, key_map=None, adapters=None
    ):
        """Wrap `model` and `optimizer` for the strategy; use what it returns.

        `example_inputs`: one batch as `train_step` will get it (a tensor or a
        dict of keyword arguments); the pipeline strategies need it to cut a
        model that is not an nn.Sequential (by the model's own pipeline plan, or
        by tracing its forward on it).
        A model compiled before setup (``torch.compile(model)``) is unwrapped
        and compiled again in place, so checkpoints keep the model's own keys.
        A model with BatchNorm adds a note (once) on which statistics it normalises with:
        only here is the model seen, so owners print `notes` after setup.
        `weights`: a Hugging Face directory (safetensors) each process reads its share of, under the model's own
        keys (`key_map`: {model key: file key} or a function, where they differ); `adapters`: a peft adapter
        directory (else a peft model's adapters start fresh). A model built on the meta device (`init_module`)
        gets storage for this process's share only, its values from `weights` or from its own initialisation:
        the same whatever the strategy and number of processes.
        """
        model, compiled = unwrap_compiled(model)
        start = Start(model, self.strategy, weights, key_map, adapters)  # checks the directory on every rank alike
        self._pretrained = Pretrained.of(model)
        start.before(model, self.device)
        compile_mode = self.compile or compiled
        self.channels_last = memory_format.apply(
            self._channels_last_asked, model, self.strategy.runtime.precision.name, self.device, self.notes
        )
        self.expert_load = ExpertLoad.attach(model)  # before ep sends tokens away; close() says the shares
        note = batchnorm_note(model, self.strategy.name, self.strategy.sync_batchnorm)
        if note and note not in self.notes:
            self.notes.append(note)
        args = SetupArgs(
            None if example_inputs is None else self.to_device(example_inputs),
            self.grad_accum,
            self.activation_checkpointing,
            compile_mode,
        )
        wrapped = self.strategy.setup(model, optimizer, args)
        self.weights_report = start.after(self.strategy, self.device)  # bytes this rank read; what it initialised
        self.notes.extend(n for n in self.strategy.notes if n not in self.notes)  # what wrap found
        if self.replicas is not None:  # torchft's Manager starts once the model is wrapped
            self.replicas.attach(self.strategy.model, self.strategy.optimizer, self.strategy.runtime.precision)
        self._returned = wrapped[0]
        self.services = in_fleet.FleetServices.start(self)  # times train_step from here on
        return wrapped

    @in_fleet.timed_loader  # under `torchfleet run`, its fetches are the data phase of each rank's steps
    def dataloader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 0,
        transform: Callable | None = None,
        collate_fn: Callable | None = None,
    ) -> DataLoader | StreamLoader:
        """This rank's share of each global batch of `batch_size` samples; `transform` runs on each sample in the
        worker reading it, `collate_fn` on the batch. A stream (IterableDataset) keeps its order (data/stream.py)."""
        rank, world = self.strategy.data_coords()
        if self.replicas is not None:  # each replica group reads its share of every global batch
            groups = self.replicas.env
            rank, world = groups.group * world + rank, groups.groups * world
        if is_stream(dataset):
            args = (rank, world, self.grad_accum, self.replicas is not None, num_workers, seed)
            return stream_loader(dataset, batch_size, *args, transform=transform, collate_fn=collate_fn)
        size = dataset_length(dataset, "dataloader")
        sampler = GlobalBatchSampler(size, batch_size, rank, world, shuffle, seed, drop_last)
        self._samplers.append(sampler)  # under replica groups: moved to the batch of torchft's step
        check_accumulation(batch_size, world, self.grad_accum)
        return batch_loader(dataset, sampler, seed, num_workers, Collate(transform, collate_fn))

    def eval_dataloader(self, dataset: Dataset, batch_size: int = 256) -> DataLoader:
        """Every sample exactly once across ranks; combine results with `all_reduce`."""
        size = dataset_length(dataset, "eval_dataloader")
        rank, world = self.strategy.data_coords()
        return DataLoader(dataset, batch_size=batch_size, sampler=ShardSampler(size, rank, world))

    # -- training ---------------------------------------------------------
    def train_step(self, inputs: Batch, targets: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """Forward, backward and optimizer step for one global batch; returns this rank's loss. A
        ``torch.compile(model)`` after setup is adopted: the first step compiles in place the module it runs."""
        if self._returned is not None:
            if adopt_late_compile(self._returned):
                self.notes.append("torch.compile after setup: train_step compiles the module it runs, in place")
            self._returned = None
        inputs, targets = self.to_device(inputs), self.to_device(targets)
        before = self.replicas.step if self.replicas is not None else 0
        with in_fleet.timed_step(self.services):  # under `torchfleet run`: the step's phases, every rank's read
            loss = self.strategy.train_step(inputs, targets, loss_fn, self.grad_accum)
        self._after_replica_step(before)
        return loss

    def _after_replica_step(self, before: int) -> None:
        """In replica groups: the loaders go to the group's step's batch; the main rank says what happened."""
        if self.replicas is not None:
            if self.replicas.step != before + 1:
                for sampler in self._samplers:
                    sampler.seek(self.replicas.step)
            for line in self.replicas.take_lines():
                self.print(f"torchfleet: {line}")

    def backward(self, loss: torch.Tensor) -> None:
        """For hand-written loops: backward with the precision's loss scaling."""
        self._hand_written_loop("backward")
        self.strategy.runtime.precision.backward(loss)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """For hand-written loops: optimizer step (through the fp16 scaler when there is one)."""
        self._hand_written_loop("step")
        if optimizer is not self.strategy.optimizer:
            raise UsageError("fleet.step() takes the optimizer fleet.setup() returned")
        before = self.replicas.step if self.replicas is not None else 0
        self.strategy.before_step()
        self.strategy.apply_gradients()  # with replica groups: averaged across them, stepped if committed
        self._after_replica_step(before)

    def _hand_written_loop(self, method: str) -> None:
        if self.strategy.schedules_steps:
            raise UsageError(
                f"fleet.{method}() is for hand-written loops, and {self.strategy.name} runs each"
                " stage's forward and backward inside torch's pipeline schedule;"
                " call fleet.train_step(inputs, targets, loss_fn) instead"
            )

    def autocast(self):
        """For hand-written loops: the forward's mixed-precision context."""
        return self.strategy.runtime.precision.autocast()

    def no_sync(self):
        """For hand-written accumulation: backward inside skips the gradient all-reduce."""
        return self.strategy.no_sync()

    def predict(self, inputs: Batch):
        return self.strategy.predict(self.to_device(inputs))

    def to_device(self, tensor: Any) -> Any:
        """A tensor, or a dict of tensors (keyword inputs), on this rank's device."""
        if isinstance(tensor, dict):
            return {k: self.to_device(v) for k, v in tensor.items()}
        moved = tensor.to(self.device, non_blocking=True) if isinstance(tensor, torch.Tensor) else tensor
        return memory_format.to_channels_last(moved) if self.channels_last else moved

    # -- collectives and printing -------------------------------------------
    rank = property(lambda self: self.env.rank, doc="This process's rank.")
    world_size = property(lambda self: self.env.world_size, doc="How many processes the job has.")
    is_main = property(lambda self: self.env.rank == 0, doc="Whether this is rank 0, which prints and writes.")
    strategy_name = property(lambda self: self.strategy.name, doc="The strategy this Fleet runs, by name.")

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """Combine a metric over all ranks: op is "mean", "sum", "max" or "min"."""
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise UsageError(f"unknown reduction {op!r}; choose one of {', '.join(ops)}")
        tensor = torch.as_tensor(value, dtype=torch.float64, device=self.device).clone()
        if dist.is_initialized():
            dist.all_reduce(tensor, ops[op])
        return tensor / self.world_size if op == "mean" and dist.is_initialized() else tensor

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main rank only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- checkpoints ------------------------------------------------------
    def save(self, path: str | os.PathLike, sharded: bool | None = None, **extra: Any) -> None:
        """Save a checkpoint directory atomically: model, optimizer, scaler, RNG states, `extra`.

        Every rank calls it. `sharded=True` writes through torch.distributed.checkpoint (the default for
        sharding strategies), so it loads with another number of processes. Under per-step fault tolerance
        the groups hold the same state and the first in the quorum writes (`writes_checkpoints`), the others
        return at once; under diloco and localsgd each group writes its own: give each its own path.
        """
        if self.replicas is not None:
            if not self.replicas.writes_checkpoints:
                return
            extra = {**(extra or {}), "replicas": self.replicas.state_dict()}  # torchft's step count
        checkpoint.save(self, path, extra, sharded=sharded)

    @property
    def writes_checkpoints(self) -> bool:
        """Whether `save` writes from this process's group (always, without replica groups)."""
        return self.replicas is None or self.replicas.writes_checkpoints

    def load(self, path: str | os.PathLike, weights_only: bool = True, same_strategy: bool = False) -> dict:
        """Verify and load what `save` wrote; returns this rank's `extra`.

        weights_only=False unpickles arbitrary objects: only for checkpoints you trust.
        same_strategy=True refuses a checkpoint another strategy wrote, in one sentence.
        """
        extra = checkpoint.load(
            self, path, weights_only=weights_only, strategy_name=self.strategy_name if same_strategy else None
        )
        if self.replicas is not None and "replicas" in extra:  # torchft's step count
            self.replicas.load_state_dict(extra["replicas"])
        return {k: v for k, v in extra.items() if k != "replicas"}

    # -- leaving when told to -----------------------------------------------
    def preempted(self) -> bool:
        """Whether the job was told to leave (a preemption signal or a spot notice, on any rank): the same answer
        on every rank. Ask on every rank at the same point, e.g. after each train_step; with many processes it
        costs one all-reduce of one number. Listening starts at the first call. On True: fleet.save, fleet.leave."""
        asked = self._leaving.asked(watch=self.env.local_rank == 0)
        return bool(self.all_reduce(float(asked), "max").item()) if dist.is_initialized() else asked

    def leave(self, checkpoint: str | os.PathLike | None = None, step: int | None = None) -> NoReturn:
        """Exit with status 75 (preempted, checkpointed: launchers and job scripts requeue on it), saying at which
        `step` and where the `checkpoint` fleet.save wrote is; every rank calls it."""
        raise self._leaving.leave(self.env.local_rank, self.is_main, step, checkpoint)

    @property
    def model_dir(self) -> Path | None:
        """Where the final model goes: SM_MODEL_DIR in a SageMaker job, else None."""
        return self.sagemaker.model_dir if self.sagemaker else None

    checkpoint_dir = property(
        lambda self: self.sagemaker.checkpoint_dir if self.sagemaker else None,
        doc="/opt/ml/checkpoints in a SageMaker job that set it (synced to S3: a restarted Spot job resumes), else None.",
    )

    def save_model(self, path: str | os.PathLike | None = None, adapters_only: bool = False) -> Path:
        """Save the trained model; call it on every rank.

        A transformers model and a directory: a Hugging Face directory that `from_pretrained` loads (safetensors
        shards, their index and config.json; a peft model's adapters in adapter/), each rank writing its share.
        Otherwise (any model, or a path ending in .pt, .pth or .bin) the state dict, torch.load-able, gathered to
        and written by the main rank. Without `path`: model.pt in `model_dir`, which SageMaker uploads.
        `adapters_only`: a peft model's adapters alone, in directory `path`, as peft's save_pretrained writes them.
        """
        return saving.save_model(self, path, adapters_only, self._pretrained)

    def finish(self) -> None:
        """After the last step, on every rank: diloco's and localsgd's groups meet a last time (close() does too)."""
        if self.replicas is not None:
            self.replicas.finish()

    def close(self) -> None:
        """Leave the process group after every rank met at a barrier (a rank tearing down its Gloo pairs while a
        peer uses them can abort), the barrier's Work kept until exit (dropped by Gloo's thread as the interpreter
        finalizes, it cannot take the GIL, and the process aborts with SIGABRT after a run that succeeded)."""
        self._leaving.stop()
        in_fleet.close(self.services)  # the metrics file closed, the page kept
        if self.expert_load is not None:
            self.expert_load.say_once(self.print, self.strategy.runtime.device)
        if self.replicas is not None:
            self.replicas.finish()
            self.replicas.close()
        if dist.is_initialized():
            work = dist.barrier(async_op=True)
            work.wait()
            _FINISHED_WORK.append(work)  # dies in this thread, at exit
            dist.destroy_process_group()


# See Fleet.close: Gloo work objects whose last reference must not be Gloo's.
_FINISHED_WORK: list = []
