"""Measuring a model's profile (plan/profile.py) once in this process.

- parameters, and how they fall into blocks (blocks.find_blocks, the units fsdp
  shards one at a time and the pipelines cut between), and the bytes per sample
  a block hands to the next (what a pipeline stage sends);
- FLOPs per sample, counted as bench counts them (bench/flops.py);
- memory: the peak tensor bytes (tensor_memory.TensorMemory, what a GPU's
  max_memory_allocated reports) of a steady-state step on fake tensors (never
  allocated), at two batch sizes, split into the forward-and-backward phase and
  the optimizer phase. Less the parameters and optimizer state, the first
  phase's peak is a line in the batch size: the activations (slope) and the
  gradients alive at the peak with the batch-independent temporaries
  (intercept). The peak is also kept at each batch the plan's ranks run, for the
  layouts that hold the whole model (a line drawn far away misses the peak
  there: its composition changes with the batch);
- time: a training step (zero_grad, forward, backward, optimizer step) at the
  batches the plan's ranks run (the global batch over 1, 2 and 4 processes;
  the memory batches where none is given) on 1 thread and on every usable
  core, each a line `fixed + per_sample x batch` through the fastest of
  several interleaved steps per batch (load from others only adds to a step;
  the fastest is the model's own cost). `fixed` is the per-operator cost
  (Python, dispatch, kernel launches) that a step pays whatever its batch; on
  a CPU it is most of a small model's step. The optimizer's step is also timed
  on its own: it is paid once a step, however many micro-batches the rest runs.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from torchfleet.models import TOKEN_MODELS
from torchfleet.plan import experts
from torchfleet.plan.first_batches import first_batches
from torchfleet.plan.profile import OPTIMIZER_STATE, Profile, StepFit
from torchfleet.plan.threads import torch_threads
from torchfleet.plan.workload import make_optimizer, train_step, workload

SHAPE_BATCH = 2  # samples of the forward that reads the model's structure (block outputs, routed rows)


def measure(
    spec: dict,
    optimizer: str,
    cores: int,
    batches: tuple[int, ...] | None = None,
    timed_steps: int | None = None,
    timed: bool = True,
    time_at: tuple[int, ...] = (),
) -> Profile:
    """The profile of `spec`'s model (bench's spec keys: model, gpt_preset, image_size, seed; precision, whose
    autocast the memory is measured under).

    `timed=False` leaves out the step times (a described GPU's compute comes from FLOPs instead)."""
    from torchfleet.bench import flops

    # every thread count set below is given back after, on an error too (threads.py says why)
    with torch_threads(torch.get_num_threads()):
        model, inputs, targets, loss_fn = workload(spec, SHAPE_BATCH)
        shape = _shape(model, inputs)
        flops_per_sample = flops.flops_per_sample(model, inputs, targets, loss_fn)
        batches = batches or first_batches(spec, optimizer, cores, timed)
        timed_steps = timed_steps or (3 if batches[0] == 1 else 7)  # a slow model's steps vary less
        torch.set_num_threads(cores)
        peaks = _Peaks(spec, optimizer, batches, shape.parameters)
        line_at = peaks.line_batches()
        # The peak at each local batch the plan's ranks run, measured there (fake tensors: any batch costs no memory):
        # a layout that runs the whole model on its rank reads it directly. The peak's composition changes with the
        # batch (gradients at small ones, activations at large), so a line drawn through batches far away misses it.
        for batch in set(time_at):
            if batch not in peaks.forward_backward and (peaks.fake or peaks.holds(batch)):
                peaks.measure(batch)
        # Timed at the batches the plan's ranks will run where it says them: the line is then drawn where it is
        # used, not extrapolated from small batches (whose choice a loaded machine skews: a slow first step picks
        # batches so small that the per-sample cost hides under the fixed one); those the machine holds.
        local = tuple(sorted({b for b in time_at if peaks.holds(b)}))
        timed_at = local if len(local) > 1 else batches
        fits, stepping_s = _timings(spec, optimizer, timed_at, cores, timed_steps) if timed else ({}, {})
    slope, fixed = peaks.activation_line(line_at)
    return Profile(
        spec["model"],
        shape.parameters,
        shape.in_blocks,
        shape.largest,
        shape.units,
        shape.boundary,
        spec.get("block_size"),
        flops_per_sample,
        optimizer,
        slope,
        fixed,
        peaks.optimizer_temporaries(),
        fits,
        timed_at if timed else batches,
        shape.pointwise_convs,
        shape.tensors,
        shape.tp_linears,
        stepping_s,
        workload_name(spec, optimizer),
        line_at,
        experts=shape.experts.experts,
        expert_layers=shape.experts.layers,
        expert_parameters=shape.experts.parameters,
        routed_bytes_per_sample=shape.experts.routed_bytes_per_sample,
        tp_whole_parameters=shape.tp_whole,
        peak_above_state={
            b: peaks.forward_backward[b] - peaks.state for b in set(time_at) if b in peaks.forward_backward
        },
    )


def _shape(model: nn.Module, inputs) -> SimpleNamespace:
    """What the model's structure says: its parameters, how they fall into blocks and fsdp units, the bytes a
    block hands on, what its tensor-parallel plan splits, and its experts."""
    from torchfleet.models.moe import MoEFeedForward
    from torchfleet.strategies.blocks import find_blocks
    from torchfleet.strategies.parallelize import fsdp_units
    from torchfleet.strategies.pipeline.stages import has_pointwise_convs

    params = sum(p.numel() for p in model.parameters())
    try:
        blocks = [module for _, module in find_blocks(model)]
    except Exception:  # noqa: BLE001 (any model: none found means one unit)
        blocks = []
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    tp_plan = getattr(model, "tp_plan", None)
    split = tp_plan(1) if callable(tp_plan) else {}
    try:  # fsdp's units as the strategy forms them (blocks that share a parameter are one), and the root
        units = len(fsdp_units(model)) + 1
    except Exception:  # noqa: BLE001 (as above)
        units = len(blocks) + 1
    return SimpleNamespace(
        parameters=params,
        in_blocks=in_blocks,
        units=units,
        boundary=_boundary_bytes(model, blocks, inputs),
        largest=max([sum(p.numel() for p in b.parameters()) for b in blocks] + [params - in_blocks]),
        pointwise_convs=has_pointwise_convs(model),
        tensors=len(list(model.parameters())),
        tp_linears=len(split) if isinstance(split, dict) else 0,
        # The built-in plans leave a mixture of experts whole (GPT.tp_plan): every tp rank holds and runs it.
        tp_whole=sum(p.numel() for m in model.modules() if isinstance(m, MoEFeedForward) for p in m.parameters()),
        experts=experts.measure(model, inputs, SHAPE_BATCH),
    )


class _Peaks:
    """The peak tensor bytes of a step's two phases at each measured batch, and the steps kept to time."""

    def __init__(self, spec: dict, optimizer: str, batches: tuple[int, ...], parameters: int):
        self.spec, self.optimizer, self.batches, self.parameters = spec, optimizer, batches, parameters
        self.state = 4 * parameters + OPTIMIZER_STATE[optimizer] * parameters  # weights and optimizer state
        self.precision = spec.get("precision", "fp32")
        self.forward_backward: dict[int, int] = {}
        self.fake = True  # measured on fake tensors (`measure` falls back to real ones where a kernel refuses)
        self.optimizer_phase: dict[int, int] = {}
        for batch in batches:
            self.measure(batch)
        # Only batches whose step this machine holds are run (a user plans GPT-2 for GPUs on a laptop): the
        # peak of `batch` is taken as if all the smallest batch's bytes beyond the state grew with the batch,
        # an over-estimate, against a third of the memory free now.
        smallest = min(batches)
        self.budget = _available_memory() / 3
        self.per_sample = max(0, self.forward_backward[smallest] - self.state) / smallest

    def measure(self, batch: int) -> None:
        """The step's peaks at `batch`, on fake tensors (shapes and dtypes, no data, no compute: MemTracker counts
        them like real ones): a model and batch this machine could not hold are measured all the same, and no
        bf16 arithmetic is asked of a CPU without bf16 instructions (gpt2's step at one sequence: 445 s against
        8 s in fp32 here). Under bf16 or fp16 the forward runs in CPU autocast to bf16 (2 bytes, as fp16), so
        the activations saved are those a GPU's autocast saves (measured in fp32 alone, the plan put resnet50 at
        batch 512 in bf16 at 39.9 GiB, where an H100 measured 21.6 GiB: docs/benchmarks/history.md)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            with FakeTensorMode():
                self._measure(batch)
        except Exception:  # noqa: BLE001 (an operator without a fake kernel for these dtypes, see below)
            if self.precision != "fp32":
                raise
            # Some operators' fake kernels refuse what their CPU kernels run: torch's grouped matrix product, which
            # transformers' mixtures of experts call, takes fp32 on a CPU and only bf16 on fake tensors. Such a
            # model is measured on real tensors, at the batches this machine holds.
            self.fake = False
            self._measure(batch)

    def _measure(self, batch: int) -> None:
        model, inputs, targets, loss_fn = workload(self.spec, batch)
        opt = make_optimizer(self.optimizer, model.parameters())
        train_step(model, opt, inputs, targets, loss_fn)  # the optimizer's state exists from here on
        self.forward_backward[batch], self.optimizer_phase[batch] = _phase_peaks(
            model, opt, inputs, targets, loss_fn, self.precision
        )

    def holds(self, batch: int) -> bool:
        return self.state + batch * self.per_sample <= self.budget

    def line_batches(self) -> tuple[int, int]:
        """The two batches the activation line is drawn through, measured.

        A slow model's timing batches, 1 and 2, are too small to draw its memory line: at them the peak comes
        at the end of backward, with every gradient alive and the activations gone, so it barely grows with
        the batch. Two larger batches are measured for memory alone and the line drawn through them (the
        largest pair of 4 and 8, 2 and 4, or 1 and 2 times the larger that the machine holds); the small-batch
        regime is the optimizer phase's peak, which the prediction takes when it is the larger.
        """
        top = max(self.batches)
        extra = (
            ()
            if len(self.batches) > 2
            else next(((k, 2 * k) for k in (4 * top, 2 * top, top) if self.holds(2 * k)), ())
        )
        for batch in extra:
            if batch not in self.forward_backward:
                self.measure(batch)
        return extra or (min(self.batches), max(self.batches))

    def activation_line(self, at: tuple[int, int]) -> tuple[float, float]:
        """(bytes per sample, batch-independent bytes) of the forward-and-backward peak above the state."""
        b1, b2 = at
        act = [self.forward_backward[b] - self.state for b in (b1, b2)]
        slope = max(0.0, (act[1] - act[0]) / (b2 - b1))
        return slope, max(0.0, act[0] - slope * b1)

    def optimizer_temporaries(self) -> float:
        """The optimizer step's peak above parameters, gradients and state."""
        return max(0.0, max(self.optimizer_phase.values()) - self.state - 4 * self.parameters)


def _timings(
    spec: dict, optimizer: str, timed_at: tuple[int, ...], cores: int, timed_steps: int
) -> tuple[dict[int, StepFit], dict[int, float]]:
    """({threads: step line}, {threads: the optimizer's step alone}) on 1 thread and on `cores`."""
    made: dict[int, tuple] = {}  # batch -> (model, optimizer, inputs, targets, loss_fn), real and stepped once
    for batch in timed_at:
        model, inputs, targets, loss_fn = workload(spec, batch)
        made[batch] = (model, make_optimizer(optimizer, model.parameters()), inputs, targets, loss_fn)
        train_step(*made[batch])
    fits, stepping_s = {}, {}
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        samples: dict[int, list[float]] = {b: [] for b in timed_at}
        optimizer_steps: list[float] = []
        for batch in timed_at:
            train_step(*made[batch])  # a first step at this thread count starts its threads
        # Interleaved, so a burst of load from elsewhere on a shared machine hits every batch alike.
        for _ in range(timed_steps):
            for batch in timed_at:
                whole, opt_part = _timed_step(*made[batch])
                samples[batch].append(whole)
                optimizer_steps.append(opt_part)
        # the fastest of each batch's steps: others' load on a shared machine only adds (probe.py's reasoning)
        fits[threads] = _fit_line({b: min(t) for b, t in samples.items()})
        stepping_s[threads] = min(optimizer_steps)  # the optimizer's step does not depend on the batch
    return fits, stepping_s


def meminfo(field: str) -> float | None:
    """Bytes of /proc/meminfo's `field` (MemTotal, MemAvailable ...); None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _available_memory() -> float:
    """Bytes of memory free for new work now (Linux's MemAvailable; the physical free pages elsewhere)."""
    available = meminfo("MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8e9


def _timed_step(model, optimizer, inputs, targets, loss_fn) -> tuple[float, float]:
    """(seconds of `train_step`, of which the optimizer's step)."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    loss_fn(output, targets).backward()
    middle = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    return end - start, end - middle


def workload_name(spec: dict, optimizer: str) -> str:
    """What a profiled step is: the model (its preset or image size) and the optimizer."""
    shape = f"-{spec.get('gpt_preset')}" if spec["model"] in TOKEN_MODELS else f"@{spec.get('image_size')}px"
    return f"{spec['model']}{shape}/{optimizer}"


def _fit_line(medians: dict[int, float]) -> StepFit:
    """Least squares `fixed + per_sample x batch` through the medians, neither part below zero."""
    xs, ys = list(medians), list(medians.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    per = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread) if spread else 0.0
    fixed = my - per * mx
    if fixed < 0:  # all per-sample: a line through the origin
        fixed, per = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return StepFit(fixed, per)


def _phase_peaks(model, opt, inputs, targets, loss_fn, precision: str = "fp32") -> tuple[int, int]:
    """Peak tensor bytes of forward-and-backward (in `precision`'s autocast, see `_Peaks.measure`), and of the
    optimizer's step."""
    import contextlib

    from torchfleet.tensor_memory import TensorMemory

    opt.zero_grad(set_to_none=True)
    mixed = torch.autocast("cpu", dtype=torch.bfloat16) if precision != "fp32" else contextlib.nullcontext()
    with TensorMemory(model, opt, inputs, targets) as forward_backward:
        with mixed:
            # The output is not held in a name: a training loop's is freed once the loss is computed, and logits
            # held through backward would add themselves to the peak measured.
            loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(inputs), targets)
        loss.backward()
    with TensorMemory(model, opt, inputs, targets) as stepping:
        opt.step()
    return forward_backward.peak_bytes("cpu"), stepping.peak_bytes("cpu")


def _boundary_bytes(model: nn.Module, blocks: list[nn.Module], inputs) -> float:
    """Bytes per sample of a block's output (the first block's), or of the model's output without blocks."""
    seen: list[float] = []

    def hook(_module, _args, output):
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(tensor, torch.Tensor) and not seen:
            seen.append(tensor.numel() * tensor.element_size() / max(1, tensor.shape[0]))

    watched = blocks[0] if blocks else model
    handle = watched.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(**inputs) if isinstance(inputs, dict) else model(inputs)
    finally:
        handle.remove()
    return seen[0] if seen else 0.0
