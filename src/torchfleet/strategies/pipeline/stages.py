"""A pipeline stage that times its compute, and helpers for cutting, sizing and feeding stages."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils import _pytree as pytree

from torchfleet.errors import UsageError
from torchfleet.strategies.base import batch_size
from torchfleet.strategies.pipeline.cutting import tied_groups


class TimedStage(PipelineStage):
    """A PipelineStage that times its compute.

    The schedules wait for received activations before calling these
    methods and send asynchronously after, so the time inside them is the
    stage's busy time; the rest of a schedule step is idle (the bubble).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = 0.0
        # Gloo and NCCL send only contiguous tensors, and a stage may end in a view (a
        # transpose in ViT's or GPT-2's attention, an expand of a mask): "input tensor has
        # to be contiguous" in the schedule's send. Outputs are made contiguous as they
        # leave the stage (a copy in the autograd graph, so backward still reaches the
        # view; a view is copied, see _own_storage), and so are the input gradients sent
        # back (get_bwd_send_ops).
        self.contiguous_hook = self.submod.register_forward_hook(_contiguous_outputs)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        grads = getattr(self, "bwd_cache", {}).get(bwd_chunk_id)
        if grads is not None:
            self.bwd_cache[bwd_chunk_id] = type(grads)(
                g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads
            )
        return super().get_bwd_send_ops(bwd_chunk_id)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # device time, not launch time

    def _timed(self, run, *args, **kwargs):
        self._sync()
        tick = time.perf_counter()
        out = run(*args, **kwargs)
        self._sync()
        self.busy += time.perf_counter() - tick
        return out

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):  # zero bubble's weight gradients, run late
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


def _contiguous_outputs(_module, _args, output):
    return pytree.tree_map_only(torch.Tensor, _own_storage, output)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    # A view (Flatten's output) is copied even when contiguous: the zero-bubble schedules
    # free a stage's outputs after the input gradients with detach_(), which torch refuses
    # on a view ("Can't detach views in-place").
    return t.clone(memory_format=torch.contiguous_format) if t._base is not None else t.contiguous()


def rows(batch, start: int, size: int):
    """Rows [start, start + size) of `batch`, the last row repeated where the batch ends first."""

    def take(t: torch.Tensor) -> torch.Tensor:
        part = t[start : start + size]
        if len(part) < size:
            part = torch.cat([part, part[-1:].expand(size - len(part), *part.shape[1:])])
        return part

    return {k: take(v) for k, v in batch.items()} if isinstance(batch, dict) else take(batch)


def predict_in_chunks(inputs, step: int, returns_scalar: bool, run: Callable, last: bool) -> tuple | None:
    """`run` (one forward through the pipeline) on each chunk of `step` rows of `inputs`, the size the
    stages were traced for (the last chunk padded), and the last stage's outputs for the whole batch:
    rows joined, the padding dropped; a scalar (a loss the model averages over its batch, nanoGPT's
    with targets) averaged over the chunks, which serial's equals when every chunk is full."""
    size = batch_size(inputs)
    if returns_scalar and size % step:
        raise UsageError(
            f"this model returns a scalar (its loss) and its pipeline stages take micro-batches"
            f" of {step}, so predict on {size} rows would pad the last one and count the padding"
            f" in that scalar; predict on a multiple of {step} rows"
        )
    outputs = [out for start in range(0, size, step) if (out := run(rows(inputs, start, step))) is not None]
    if not last:
        return None
    return tuple(
        torch.stack(parts).mean() if parts[0].dim() == 0 else torch.cat(parts)[:size]
        for parts in zip(*outputs, strict=True)
    )


def sequential_ties(model: nn.Module, bounds) -> list[tuple[list[str], list[int]]]:
    """Tied parameters of a Sequential cut by children, with the stages holding them."""
    children = [name for name, _ in model.named_children()]
    out = []
    for names in tied_groups(model):
        holders = sorted({s for s, (a, b) in enumerate(bounds) for n in names if n.split(".", 1)[0] in children[a:b]})
        if len(holders) > 1:
            out.append((names, holders))
    return out


# ATen's CPU convolution takes its native path instead of oneDNN for 1x1 kernels
# when a process has one thread and a batch has fewer than 16 samples (use_mkldnn
# in Convolution.cpp). A bottleneck ResNet is mostly 1x1 convolutions, so its
# micro-batches below this run at less than half the speed a sample (docs/benchmarks/history.md,
# "Real models on this machine").
SLOW_CONV_BELOW = 16


def has_pointwise_convs(model: nn.Module) -> bool:
    """Whether the model has a 1x1 convolution without stride or dilation (see SLOW_CONV_BELOW)."""
    return any(
        isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        and set(m.kernel_size) == {1}
        and set(m.stride) == {1}
        and set(m.dilation) == {1}
        for m in model.modules()
    )


def default_microbatches(batch: int, stages: int, allowed: Callable[[int], bool], slow_small_convs: bool) -> int | None:
    """Without --microbatches: the most micro-batches, from 2 x stages down, that divide the batch.

    `allowed` says which counts the schedule takes (1F1B needs at least one per
    stage, the interleaved schedules whole rounds). Where small batches make convolutions
    slow (`slow_small_convs`), micro-batches keep SLOW_CONV_BELOW samples or
    more where the batch allows, else as many as the fewest count gives.
    None when no count fits (the step then says what would).
    """
    fits = [m for m in range(2 * stages, 0, -1) if batch % m == 0 and allowed(m)]
    if fits and slow_small_convs:
        fits = [m for m in fits if batch // m >= SLOW_CONV_BELOW] or fits[-1:]
    return fits[0] if fits else None


# A tag of its own, so that under Gloo and MPI the loss never pairs with a schedule's activation or
# gradient between the same two processes. NCCL ignores tags: there the order of posting keeps them
# apart, so the loss is posted on both sides only after the schedule's sends and receives of the step.
LOSS_TAG = 0x10E5
TAGGED_BACKENDS = ("gloo", "mpi")


def receive_loss(loss: torch.Tensor, src: int, group) -> list:
    """Post the receive of the batch's loss from the process holding the last stage (global rank `src`).

    Under Gloo this is posted before the schedule runs, so the loss lands while this process still
    computes, and waiting for it after the optimizer step costs nothing. Posted after the schedule, the
    exchange's round trip is added to the first stage's step; a blocking broadcast after the optimizer step
    costs as much, and an asynchronous one overlapping it hung in parity launches (docs/benchmarks/history.md)."""
    return [dist.irecv(loss, src=src, group=group, tag=LOSS_TAG)]


def send_loss(loss: torch.Tensor, group) -> list:
    """Post the batch's loss from this process (the last stage's) to every other process of its pipeline."""
    me = dist.get_rank()
    peers = (dist.get_global_rank(group, peer) for peer in range(dist.get_world_size(group)))
    return [dist.isend(loss, dst=peer, group=group, tag=LOSS_TAG) for peer in peers if peer != me]
