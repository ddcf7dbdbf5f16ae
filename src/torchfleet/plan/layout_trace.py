"""A layout's memory traced, not estimated: the strategy's own setup and step on fake tensors and a fake group.

The strategies built on FSDP2 and DTensor (fsdp, hsdp, tp, fsdp+tp, ep, fsdp+ep), mp and
the pipelines split a model in ways a formula over the whole model's profile only
approximates: which activations tp splits, what FSDP2 holds gathered and for
how long, what each stage holds of its micro-batches. Their memory is instead taken from one rank of the layout itself:
torchfleet's Fleet sets the model up and trains it for a step on fake tensors
(torch's FakeTensorMode: shapes and dtypes, never allocated) over a fake
process group of the layout's size (collectives that move nothing), and
MemTracker reads the tensors' peak over two more steps, as `plan --check`
reads a real rank's. On gpt tiny under tp 2 the trace equals the real
processes' peak to the byte (8,233,480 bytes). A pipeline's stages are uneven
(cnn's last holds its 131,200-parameter Linear), so each stage's rank is traced
and the largest taken; torch's pipeline stages, which cannot learn their shapes
over a fake group, are given them (strategies/pipeline/static_shapes.py).

Three things are kept out of the fake mode while tracing: the device mesh
(built from real rank tensors), DTensor's shape propagation
(tensor_parallel.traceable), and a move of the model to the device it is
already on (which fake parameters refuse: they cannot be swapped in place).
And two things Gloo does, which the layouts here run on, and the fake group
does not, are added: its reduce-scatter copies its whole input once more while
it works (seen as a split and a copy after the collective: on mlp under fsdp 2
the largest block's 66,048 bytes of gradients, which make the step's peak);
and a send's work keeps the tensor it sent for as long as the work lives (a
pipeline schedule keeps a step's sends: without them the trace of gpt tiny
under interleaved-1f1b was 5 boundary activations short, 4.3%).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

# The strategies whose preset says `traced` have their setup and step run on fake tensors; the rest keep the
# profile's formulas (ddp's reducer is C++ that needs real storage). ep's routing, which has no values to
# route by, sends every expert an even share (expert_parallel._balanced). The pipelines' replicas go through
# FSDP2 (strategies/parallelize.py), and their stages are given their shapes (pipeline/static_shapes.py).
TRACED_STEPS = 2


@dataclass(frozen=True)
class TracedPeak:
    """A rank's peak tensor bytes, traced: `prompt` when each collective's buffers are freed as the step lets
    them go; `late` when Gloo's worker thread still holds a reduce-scatter's copy of its input until the next
    one (seen on real runs here in about one step in ten: +524,800 bytes, cnn's largest block, under fsdp 2)."""

    prompt: float
    late: float


def traced_peak(
    spec: dict, optimizer: str, strategy: str, processes: int, global_batch: int, options: dict
) -> TracedPeak:
    """The largest rank of `strategy` on `processes` ranks (`options`: the strategy's own, a pipeline's schedule):
    `spec`'s model (bench's keys) at `global_batch`, trained with `optimizer` (workload.make_optimizer's names)."""
    prompts, lates = [], []
    for rank in traced_ranks(strategy, processes):
        prompt, copied = _peak(spec, optimizer, strategy, processes, global_batch, options, rank, held=False)
        prompts.append(prompt)
        # Only a step that reduce-scatters has a copy to free late: traced again holding it.
        late = _peak(spec, optimizer, strategy, processes, global_batch, options, rank, held=True)[0] if copied else 0
        lates.append(late)
    return TracedPeak(max(prompts), max(*prompts, *lates))


def traced_ranks(strategy: str, processes: int) -> list[int]:
    """The ranks whose peaks can differ: one per pipeline stage (stages are uneven), else rank 0 (the others hold
    an even share of the same)."""
    from torchfleet.strategies.dims import ParallelDims
    from torchfleet.strategies.registry import find

    preset = find(strategy)
    if preset is None or preset.degrees is None:
        return [0]
    dims = ParallelDims.from_preset(strategy, processes)
    return [r for r in range(processes) if all(v == 0 for k, v in dims.coords(r).items() if k != "pp")]


def _peak(
    spec: dict, optimizer: str, strategy: str, processes: int, global_batch: int, options: dict, rank: int, held: bool
) -> tuple[float, bool]:
    """`rank`'s peak tensor bytes, and whether its step reduce-scattered (Gloo's copy, _gloo_reduce_scatter)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchfleet.env.dist_env import DistEnv
    from torchfleet.fleet import Fleet
    from torchfleet.plan import tensor_parallel, workload
    from torchfleet.tensor_memory import TensorMemory

    if dist.is_initialized():
        raise RuntimeError("plan traces a layout on a fake process group of its own: call it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=processes)
    env = DistEnv(rank=rank, local_rank=rank, world_size=processes, local_world_size=processes)
    try:
        with (
            tensor_parallel.traceable(),
            _mesh_outside_fake(),
            _no_move_in_place(),
            _gloo_reduce_scatter(held) as copies,
            _sends_kept_by_their_work(),
            FakeTensorMode(),
        ):
            fleet = Fleet(strategy=strategy, precision=spec.get("precision", "fp32"), env=env, **options)
            _, readers = fleet.strategy.data_coords()
            model, inputs, targets, loss_fn = workload.workload(spec, global_batch // readers)
            opt = workload.make_optimizer(optimizer, model.parameters())
            model, opt = fleet.setup(model, opt, example_inputs=inputs)
            fleet.train_step(inputs, targets, loss_fn)  # the optimizer's state exists from here on
            with TensorMemory(model, opt) as memory:
                for _ in range(TRACED_STEPS):
                    fleet.train_step(inputs, targets, loss_fn)
            fleet.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return float(memory.peak_bytes("cpu")), bool(copies)


@contextlib.contextmanager
def _mesh_outside_fake():
    """The strategies' device mesh is built from real rank tensors, outside the fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from torchfleet.strategies import dims

    build = dims.init_device_mesh

    def real_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return build(*args, **kwargs)

    dims.init_device_mesh = real_mesh
    try:
        yield
    finally:
        dims.init_device_mesh = build


@contextlib.contextmanager
def _no_move_in_place():
    """`model.to(device)` for a model already there is left undone: fake parameters cannot be swapped."""
    import torch
    from torch import nn

    to = nn.Module.to

    def to_unless_there(self, *args, **kwargs):
        device = args[0] if args and isinstance(args[0], (str, torch.device)) else kwargs.get("device")
        if device is not None and len(args) <= 1 and set(kwargs) <= {"device"}:
            there = torch.device(device)
            if all(t.device == there for t in (*self.parameters(), *self.buffers())):
                return self
        return to(self, *args, **kwargs)

    nn.Module.to = to_unless_there
    try:
        yield
    finally:
        nn.Module.to = to


@contextlib.contextmanager
def _gloo_reduce_scatter(held: bool):
    """FSDP2's reduce-scatter (reduce_scatter_single from torch 2.14, reduce_scatter_tensor before) makes a copy
    of its input, as Gloo's does: freed at once, or (`held`) kept until the next reduce-scatter's."""
    import torch
    import torch.distributed as dist

    names = ("reduce_scatter_single", "reduce_scatter_tensor")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    kept: list[torch.Tensor] = []
    made: list[int] = []  # yielded: one entry per copy made, so the caller knows whether there were any

    def copying(collective):
        def call(*args, **kwargs):
            given = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
            done = collective(*args, **kwargs)
            if isinstance(given, torch.Tensor):
                kept.clear()
                made.append(given.numel())
                copy = torch.empty_like(given)
                if held:
                    kept.append(copy)
                del copy
            return done

        return call

    for name, collective in originals.items():
        setattr(dist, name, copying(collective))
    try:
        yield made
    finally:
        kept.clear()
        for name, collective in originals.items():
            setattr(dist, name, collective)


@contextlib.contextmanager
def _sends_kept_by_their_work():
    """A send's work keeps its tensor for as long as the work lives, as Gloo's does (waited on or not); the fake
    group's keeps nothing. A pipeline schedule holds a step's send works, so the activations and input gradients it
    sent stay: on gpt tiny under interleaved-1f1b on 2 processes, 5 and 7 boundary activations of 131,072 bytes."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    send = distributed_c10d.isend

    class Keeping:
        def __init__(self, work, tensor):
            self.work, self.tensor = work, tensor

        def __getattr__(self, name):
            return getattr(self.work, name)

    def keeping(tensor, *args, **kwargs):
        work = send(tensor, *args, **kwargs)
        return Keeping(work, tensor) if work is not None else None

    dist.isend = distributed_c10d.isend = keeping
    try:
        yield
    finally:
        dist.isend = distributed_c10d.isend = send
