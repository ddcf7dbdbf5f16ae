"""One cell of `torchfleet bench`, run inside each of the cell's own fresh processes.

A cell is one strategy x process count x global batch x precision. The parent
(launch_cell.py) starts it through `torchfleet.launcher.launch`, so every cell has
new processes and a new process group, and nothing one cell leaves behind
(allocator caches, warmed-up threads, a broken group) touches the next.

What is measured, and how:
- step time: `Fleet.train_step` on one in-memory `MockLoader` batch (loading
  is not timed), after `warmup` untimed steps. Every timed step starts from a
  barrier, is bracketed by device synchronisation on CUDA, and counts as the
  slowest rank's time, since the step is not over until every rank is done.
- communication share (strategies that override `no_sync`, i.e. whose gradient
  synchronisation can be skipped): the same step is timed inside `no_sync()`
  too, interleaved with the synced steps so drift hits both alike; the share
  is (median synced - median unsynced) / median synced: the time gradient
  communication adds to a step after whatever overlap with backward the
  strategy achieves. Differences within noise below zero read as 0.
- peak memory per rank: on CUDA `torch.cuda.max_memory_allocated` since just
  before the model was built. On CPU, the growth of the process's peak
  resident set (VmHWM, reset through /proc/self/clear_refs just before the
  model was built) over its resident set then, less the file-backed pages
  (shared-library code) mapped meanwhile: model, gradients, optimizer state,
  activations and communication buffers, as the OS counts them. A throwaway
  step of a tiny model first takes torch's one-time start-up (autograd's
  engine, the optimizer's code, about 160 MiB here) out of the figure.
- other processes' CPU (machine_load.py): the CPUs' busy seconds over the
  cell's run, from its start to its last timed step, less every rank's own
  CPU seconds over it, per second of it: the cores others took meanwhile.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchfleet import machine_load
from torchfleet.bench import flops, kernels, user_model
from torchfleet.bench.config import MAX_ROUND_STEPS
from torchfleet.data import check_global_batch
from torchfleet.fleet import Fleet
from torchfleet.models import DIGITS_INPUT, IMAGE_MODELS, TOKEN_MODELS, build_model, gpt_config, lm_loss
from torchfleet.strategies import Strategy
from torchfleet.train.datasets import MockLoader, MockTokens
from torchfleet.train.models import build_optimizer

# Input shape of each model's mock batch: the digits' 8x8 for the small models,
# ImageNet's 224x224 for the ResNets (or --image-size), as in the benchmark
# notebook of the seeds. gpt's batch is random tokens, its preset's block long.
DEFAULT_INPUT = DIGITS_INPUT

CPU_MEMORY_METHOD = (
    "peak resident set growth from just before the model was built, less file-backed"
    " pages mapped meanwhile (VmHWM - VmRSS - RssFile growth)"
)
CUDA_MEMORY_METHOD = "torch.cuda.max_memory_allocated"
COMM_METHOD = "(median synced step - median no_sync step) / median synced step, interleaved"


def input_shape(model: str, image_size: int = 224) -> tuple[int, ...]:
    return (3, image_size, image_size) if model in IMAGE_MODELS else DEFAULT_INPUT


def measures_comm(strategy_cls: type[Strategy]) -> bool:
    """Whether the strategy's gradient synchronisation can be switched off to time it."""
    return strategy_cls.no_sync is not Strategy.no_sync


# ---- memory ------------------------------------------------------------------------------


def _proc_status_kib(field: str) -> int | None:
    try:
        found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) if found else None


class _PeakMemory:
    """Peak memory this cell adds, from `start()` to `peak_bytes()` (see the module doc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = self.file_base = 0
        self.method = CUDA_MEMORY_METHOD if device.type == "cuda" else CPU_MEMORY_METHOD

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        _prime_torch()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        except OSError:
            self.method = "unavailable here (needs Linux's /proc/self/clear_refs)"
        self.base = (_proc_status_kib("VmRSS") or 0) * 1024
        self.file_base = (_proc_status_kib("RssFile") or 0) * 1024

    def peak_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        if self.method != CPU_MEMORY_METHOD:
            return None
        files = (_proc_status_kib("RssFile") or 0) * 1024 - self.file_base
        return (_proc_status_kib("VmHWM") or 0) * 1024 - self.base - files


def _prime_torch() -> None:
    """One step of a tiny model, so torch's one-time start-up is not counted as the cell's memory."""
    layer = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    nn.functional.cross_entropy(layer(torch.rand(2, 4)), torch.tensor([0, 1])).backward()
    optimizer.step()


# ---- timing ------------------------------------------------------------------------------


def _timed(step, device: torch.device) -> float:
    if dist.is_initialized():
        dist.barrier()  # every rank starts the step together
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _gathered(value):
    """`value` from every rank, in rank order (just [value] in one process)."""
    if not dist.is_initialized():
        return [value]
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, value)
    return found


def spread(times: list[float]) -> dict:
    """Median, quartiles and extremes of step times, in seconds."""
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return {
        "step_time_median_s": statistics.median(times),
        "step_time_q1_s": q1,
        "step_time_q3_s": q3,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
    }


def round_steps(times: list[float], spec: dict) -> int:
    """How many timed steps the round should have, seen from `times` so far: `spec`'s steps at least, then as
    many as take its round_time_s at their median, at most MAX_ROUND_STEPS; len(times) once that many ran.
    The median, not the sum: a step stalled for a moment by another process must not end the round early."""
    median = statistics.median(times)
    wanted = math.ceil(spec.get("round_time_s", 0.0) / median) if median > 0 else MAX_ROUND_STEPS
    return max(len(times), min(MAX_ROUND_STEPS, wanted))


# ---- the cell ----------------------------------------------------------------------------


def run_cell(spec: dict) -> dict | None:
    """Measure one cell; the main rank returns its figures, the others None.

    `spec` holds model, gpt_preset, image_size, strategy, processes, global_batch,
    precision, threads, warmup, steps, seed and options (the strategy's options).
    """
    span = machine_load.Span()  # on every rank: its own CPU seconds; the main rank's CPUs' busy seconds
    torch.set_num_threads(spec["threads"])
    fleet = Fleet(
        strategy=spec["strategy"],
        precision=spec["precision"],
        compile=spec.get("compile") or False,
        channels_last=spec.get("channels_last"),
        **spec["options"],
    )
    # No try/finally: a rank that failed must not wait at close()'s barrier for
    # peers stuck in a collective; it exits, and the launcher stops the others.
    result = _measure(fleet, spec, span)
    fleet.close()
    return result


def profile_name(spec: dict) -> str:
    """The cell's name for its kernel summary: model, batch, precision, compile, optimizer and layout where
    not the default (sgd, channels-first: `channels_last` is what the cell ran, not what was asked)."""
    preset = f"-{spec['gpt_preset']}" if spec["model"] in TOKEN_MODELS else ""
    optimizer = "" if spec.get("optimizer", "sgd") == "sgd" else f"-{spec['optimizer']}"
    layout = "-nhwc" if spec.get("channels_last") else ""
    return (
        f"{spec['model'].replace(':', '.')}{preset}-b{spec['global_batch']}-{spec['precision']}"
        f"-{spec.get('compile') or 'eager'}{optimizer}{layout}-{spec['strategy']}x{spec['processes']}"
    )


def workload(spec: dict, local_batch: int, rank: int, fleet: Fleet) -> tuple[nn.Module, Any, Any, Any]:
    """(model, inputs, targets, loss_fn): the cell's model, built alike on every rank, and the one
    batch of `local_batch` samples that data-parallel `rank` steps on (its own, from seed + rank).

    `spec` names model, gpt_preset, image_size and seed; bench's link mode (bench/link) uses it too.
    """
    torch.manual_seed(spec["seed"])  # the same initial weights on every rank
    if user_model.is_user_model(spec["model"]):
        model, make_batch, loss_fn = user_model.build(spec["model"])
        torch.manual_seed(spec["seed"] + rank)  # each data-parallel rank its own batch
        inputs, targets = (fleet.to_device(t) for t in make_batch(local_batch))
    elif spec["model"] in TOKEN_MODELS:
        model = build_model(spec["model"], gpt_preset=spec["gpt_preset"])
        gpt = gpt_config(spec["gpt_preset"])
        inputs, targets = next(
            iter(MockTokens(local_batch, gpt.block_size, gpt.vocab_size, device=fleet.device, seed=spec["seed"] + rank))
        )
        loss_fn = lm_loss
    else:
        shape = input_shape(spec["model"], spec["image_size"])
        model = build_model(spec["model"], shape, num_classes=10)
        inputs, targets = next(iter(MockLoader((local_batch, *shape), device=fleet.device, seed=spec["seed"] + rank)))
        loss_fn = nn.CrossEntropyLoss()
    return model, inputs, targets, loss_fn


def _measure(fleet: Fleet, spec: dict, span: machine_load.Span) -> dict | None:
    rank, readers = fleet.strategy.data_coords()
    check_global_batch(spec["global_batch"], readers)
    local_batch = spec["global_batch"] // readers
    memory = _PeakMemory(fleet.device)
    memory.start()
    model, inputs, targets, loss_fn = workload(spec, local_batch, rank, fleet)
    # Counted on a meta copy (shapes only), before setup splits or shards the model.
    model_flops = flops.flops_per_sample(model, inputs, targets, loss_fn) if fleet.is_main else None
    optimizer = build_optimizer(spec.get("optimizer", "sgd"), model.parameters(), 1e-3, fleet.device)
    fleet.setup(model, optimizer, example_inputs=inputs)  # pipelines trace a model that is not a Sequential

    def synced():
        fleet.train_step(inputs, targets, loss_fn)

    def unsynced():
        with fleet.no_sync():
            fleet.train_step(inputs, targets, loss_fn)

    # tp's all-reduces sit inside forward and backward, where no_sync cannot skip them:
    # timing it would read as no communication, so a tp cell's share is not measured.
    dims = getattr(fleet.strategy, "dims", None)  # a mesh strategy's
    comm = measures_comm(type(fleet.strategy)) and (dims is None or dims.tp == 1)
    first_step = None  # seconds: with --compile, mostly the compilation
    for _ in range(spec["warmup"]):
        took = _timed(synced, fleet.device)
        first_step = took if first_step is None else first_step
        if comm:
            unsynced()
    times, local_times = [], []
    target = spec["steps"]
    while len(times) < target:
        times.append(_timed(synced, fleet.device))
        if comm:
            local_times.append(_timed(unsynced, fleet.device))
        if len(times) == target:  # every rank is here at once: they agree on the round's length
            target = max(_gathered(round_steps(times, spec)))
    peak = memory.peak_bytes()
    span.end()
    # After the peak is read (the profiler's buffers are not the cell's); every rank steps, the main one writes.
    # Once per cell: bench asks for it in the last round only.
    if spec.get("profile", True):
        name = profile_name({**spec, "channels_last": fleet.channels_last})
        kernels.profile_steps(synced, fleet.device, name, write=fleet.is_main)

    # A step lasts as long as its slowest rank.
    per_rank = _gathered((times, local_times, peak, span.own_cpu_s))
    if not fleet.is_main:
        return None
    step_times = [max(t[i] for t, _, _, _ in per_rank) for i in range(len(times))]
    result = {
        **spread(step_times),
        "step_times_s": step_times,
        "timed_steps": len(step_times),
        "others_cores": span.others_cores(sum(cpu for *_, cpu in per_rank)),
        "local_batch": local_batch,
        "threads_per_process": torch.get_num_threads(),
        "device": str(fleet.device),
        "device_name": torch.cuda.get_device_name(fleet.device) if fleet.device.type == "cuda" else None,
        "flops_per_sample": model_flops,
        "backend": fleet.strategy.runtime.backend or "none",
        "peak_memory_bytes": [p for _, _, p, _ in per_rank],
        "memory_method": memory.method,
        "comm_share": None,
        "comm_method": None,
        "notes": list(fleet.notes),
        "first_step_s": first_step,
        "channels_last": fleet.channels_last,
    }
    if comm:
        unsynced_times = [max(t[i] for _, t, _, _ in per_rank) for i in range(len(local_times))]
        synced_median = statistics.median(step_times)
        saved = synced_median - statistics.median(unsynced_times)
        result["comm_share"] = max(0.0, saved / synced_median)
        result["comm_method"] = COMM_METHOD
    return result
