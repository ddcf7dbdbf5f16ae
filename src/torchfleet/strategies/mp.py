"""mp: one process, the model cut into consecutive stages on a list of devices.

An `nn.Sequential` is cut automatically into as many stages as there are
devices, balanced by parameter count; or the user passes the stages as a list
of modules. Each batch is split into micro-batches that flow through the
stages as a wavefront: while stage s works on micro-batch i, stage s+1 works
on micro-batch i-1. CUDA kernels launch asynchronously, so stages on
different GPUs run at the same time: the split-size pipelining of PyTorch's
single-machine model-parallel tutorial, for any number of stages. The outputs
are concatenated on the last device before the loss, so the loss and its
gradient are the whole batch's, exactly as in serial.

    Fleet(strategy="mp", devices="cuda:0,cuda:1", microbatches=4)
    Fleet(strategy="mp", devices="cpu,cpu")   # checks the split and the flow on any host
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from torchfleet.errors import UsageError
from torchfleet.precision import Precision
from torchfleet.strategies.base import Strategy
from torchfleet.strategies.distributed import names_option
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategies.partition import partition
from torchfleet.strategies.pipeline.cutting import stage_starts

DEFAULT_MICROBATCHES = 4


def parse_devices(spec) -> list[torch.device]:
    """ "cuda:0,cuda:1" (or a list of names or devices) as devices that exist here."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    hint = "give comma-separated devices such as cuda:0,cuda:1 or cpu,cpu"
    devices = []
    for name in names:
        try:
            device = torch.device(name.strip() if isinstance(name, str) else name)
        except (RuntimeError, TypeError):
            raise UsageError(f"device {name!r} in --devices is not a device name; {hint}") from None
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            device = torch.device("cuda", device.index or 0)
            if device.index >= count:
                raise UsageError(f"device {device} in --devices is not visible here ({count} GPUs); {hint}")
        elif device.type != "cpu":
            raise UsageError(f"device {device} in --devices is neither cpu nor cuda; {hint}")
        devices.append(device)
    if not devices or not str(spec).strip():
        raise UsageError(f"--devices {spec!r} names no device; {hint}")
    return devices


def default_devices() -> list[torch.device]:
    """Every visible GPU; with fewer than two, two stages on the one device there is."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        return [torch.device("cuda", i) for i in range(gpus)]
    return [torch.device("cuda", 0) if gpus else torch.device("cpu")] * 2


def balanced_split(weights: list[int], parts: int) -> list[int]:
    """Sizes of `parts` consecutive non-empty groups of `weights` with the smallest largest sum."""
    return partition(weights, parts)


def split_sequential(model: nn.Sequential, parts: int) -> list[nn.Sequential]:
    """`model` cut into `parts` consecutive stages balanced by parameter count (modules shared)."""
    layers = list(model)
    if len(layers) < parts:
        raise UsageError(
            f"the model has {len(layers)} layers, too few for {parts} stages; give at most {len(layers)} devices"
        )
    sizes = balanced_split([sum(p.numel() for p in layer.parameters()) for layer in layers], parts)
    stages, start = [], 0
    for size in sizes:
        stages.append(nn.Sequential(*layers[start : start + size]))
        start += size
    return stages


class MicroBatchPipe(nn.Module):
    """Stages on devices, fed micro-batches as a wavefront; returns the whole batch's output."""

    def __init__(self, stages: Sequence[nn.Module], devices: list[torch.device], microbatches: int):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.devices = list(devices)
        self.microbatches = microbatches

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        flow = [chunk for chunk in inputs.tensor_split(self.microbatches) if len(chunk)]
        depth = len(self.stages)
        for clock in range(len(flow) + depth - 1):
            # At each clock stage s takes micro-batch clock - s. Later stages are
            # queued first, as in the tutorial's loop, so a downstream device is
            # handed its work before the upstream one's next chunk is copied over.
            for s in reversed(range(depth)):
                i = clock - s
                if 0 <= i < len(flow):
                    flow[i] = self.stages[s](flow[i].to(self.devices[s]))
        return torch.cat(flow)


class ModelParallel(Strategy):
    takes = ("devices", "microbatches", "split_points")

    def __init__(self, runtime, options: StrategyOptions | None = None):
        options = options or StrategyOptions()
        super().__init__(runtime, options)
        spec, microbatches = options.single_process.devices, options.pipeline.microbatches
        self.devices = parse_devices(spec) if spec is not None else default_devices()
        self.microbatches = microbatches or DEFAULT_MICROBATCHES
        self.split_points = names_option(options.pipeline.split_points)
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise UsageError(f"--microbatches {microbatches!r} must be a whole number, at least 1")
        # The loss is computed where the last stage leaves its output, and
        # autocast follows the first stage's device type.
        self.runtime = dataclasses.replace(
            runtime, device=self.devices[-1], precision=Precision(runtime.precision.name, self.devices[0])
        )
        if len(set(self.devices)) == 1 and len(self.devices) > 1:
            self.notes.append(
                f"mp: all {len(self.devices)} stages are on {self.devices[0]}, so they cannot"
                " overlap; this checks the split and the micro-batches, give two GPUs for speed"
            )
        self.whole: nn.Module | None = None

    def wrap(self, model, optimizer, args):
        if isinstance(model, (list, tuple, nn.ModuleList)):
            stages = list(model)
            if len(stages) != len(self.devices):
                raise UsageError(
                    f"mp was given {len(stages)} stages for {len(self.devices)} devices; give one device per stage"
                )
            self.whole = nn.Sequential(*stages)
        elif isinstance(model, nn.Sequential) and not self.split_points:
            stages = split_sequential(model, len(self.devices))
            self.whole = model
        else:
            return self._place(model, optimizer)
        for stage, device in zip(stages, self.devices, strict=True):
            stage.to(device)  # in place: the optimizer's parameters move with it
        self.model = MicroBatchPipe(stages, self.devices, self.microbatches)
        self.optimizer = optimizer
        return self.model, self.optimizer

    def _place(self, model: nn.Module, optimizer):
        """Any other model: its modules placed on the devices in forward order, cut where stages begin.

        The cut is the pipeline's (split_points, or between the repeated blocks);
        each module with parameters takes its inputs to its own device, so the
        forward runs unchanged, one stage after another (no micro-batch wavefront:
        that needs the model as a sequence of stages).
        """
        starts = stage_starts(model, len(self.devices), self.split_points)
        stage = 0
        for name, module in model.named_modules():
            if stage + 1 < len(self.devices) and name == starts[stage]:
                stage += 1
            own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
            if own:
                if any(t.device != self.devices[stage] for t in own):  # (plan's fake tensors cannot be moved)
                    module._apply(
                        lambda t, d=self.devices[stage]: t.to(d), recurse=False
                    )  # in place: the optimizer keeps them
                module.register_forward_pre_hook(_inputs_to_own_device, with_kwargs=True)
        self.notes.append(
            f"mp: a {type(model).__name__} is placed on {len(self.devices)} devices, stages"
            f" starting at {', '.join(starts)}; they run one after another (micro-batches"
            " overlap only for an nn.Sequential)"
        )
        self.whole = self.model = model
        self.optimizer = optimizer
        return self.model, self.optimizer

    def unwrapped(self) -> nn.Module:
        # The user's Sequential (or the stages in one): checkpoints keep serial's keys.
        assert self.whole is not None, "mp: unwrapped() before wrap()"
        return self.whole

    def train_step(self, inputs, targets, loss_fn, grad_accum: int = 1):
        def on_output_device(output, target):
            leaf = (
                output
                if isinstance(output, torch.Tensor)
                else next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))
            )
            return loss_fn(output, target.to(leaf.device))

        return super().train_step(inputs, targets, on_output_device, grad_accum)


def _inputs_to_own_device(module: nn.Module, args, kwargs):
    device = next(iter(module.parameters(recurse=False)), None)
    device = device.device if device is not None else next(module.buffers(recurse=False)).device
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tree_map(move, args), tree_map(move, kwargs)
