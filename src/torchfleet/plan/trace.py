"""One training step of a library model traced on fake tensors: memory per GPU by kind, never allocated.

The step is the one torchtitan trains: every decoder block and then the root
sharded by FSDP2 (fully_shard) over `world` ranks, bf16 compute with fp32
master weights and fp32 gradient reduction (MixedPrecisionPolicy) where the
precision is bf16, AdamW, and cross-entropy on the logits cast to fp32.
Activation checkpointing wraps each block: "full" recomputes the whole block,
"selective" keeps what torchtitan's operator-level policy keeps (the output of
every other matrix product and of attention, recomputing the rest).

torch's FSDPMemTracker (torch.distributed._tools) follows every tensor of one
step, with AdamW's state made beforehand, under FakeTensorMode and a fake
process group, and gives the memory by kind after every operator: sharded and
unsharded parameters, gradients, optimizer state, activations, temporaries,
all-gather and reduce-scatter buffers. The same pass counts the step's FLOPs.
On one H200 (torch 2.11) the tracker's peak matched max_memory_allocated within
0.1% in 4 of 5 Llama-shaped cells; traced here on the CPU, a 1B shape's peak is
within 0.3% of a real H100's and its FLOPs equal the H100's count
(docs/benchmarks.md).

Tracing costs time per operator, so deep models are traced at three or more
small depths and the figures carried to the full depth: every block is the
same, so each kind grows by the same amount per block (`at_depth`) once the
same moment is the peak. The sharded kinds shrink with the number of ranks and
nothing else does (`at_world`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

AC_MODES = ("none", "selective", "full")
# What FSDP2 divides among the ranks: every other kind is held whole by each rank.
SHARDED_KINDS = ("SHARDED_PARAM", "SHARDED_GRAD", "OPT")
TRACE_DEPTHS = (2, 4)  # decoder blocks traced first; deeper models are carried from these and deeper ones
TRACE_WORLD = 8  # ranks traced; other worlds scale the sharded kinds (Traced.at_world)


@dataclass(frozen=True)
class Workload:
    seq: int
    local_batch: int
    ac: str = "selective"
    precision: str = "bf16"


@dataclass(frozen=True)
class Traced:
    """One rank's memory by kind (bytes) at the moments of a step that can be its peak, for `layers` blocks
    sharded over `world` ranks. Which moment is the peak depends on the world: the sharded kinds shrink as
    it grows and the rest does not, so every moment that is highest for some world is kept."""

    layers: int
    world: int
    moments: tuple[dict[str, float], ...]
    flops: float = 0.0  # one rank's step, by torch's FLOP formulas (recomputation included)

    @property
    def kinds(self) -> dict[str, float]:
        """The peak moment's figures."""
        return max(self.moments, key=lambda kinds: sum(kinds.values()))

    @property
    def peak(self) -> float:
        return sum(self.kinds.values())

    def at_world(self, world: int) -> Traced:
        scale = self.world / world
        return Traced(self.layers, world, tuple({k: v * scale if k in SHARDED_KINDS else v for k, v in m.items()}
                                                for m in self.moments), self.flops)


def candidate_moments(moments: list[dict[str, float]]) -> tuple[dict[str, float], ...]:
    """The moments that are the peak for some number of ranks: those no other moment exceeds in both the
    sharded and the whole-held kinds."""
    def split(kinds):
        sharded = sum(v for k, v in kinds.items() if k in SHARDED_KINDS)
        return sum(kinds.values()) - sharded, sharded

    kept, best_sharded = [], -1.0
    for kinds in sorted(moments, key=lambda m: (-split(m)[0], -split(m)[1])):
        if split(kinds)[1] > best_sharded:
            kept.append(kinds)
            best_sharded = split(kinds)[1]
    return tuple(kept)


def at_depth(low: Traced, high: Traced, layers: int) -> Traced:
    """The figures for `layers` blocks, carried linearly from traces at two depths (same world)."""
    low_kinds, high_kinds = low.kinds, high.kinds
    per_block = {k: (high_kinds.get(k, 0.0) - low_kinds.get(k, 0.0)) / (high.layers - low.layers)
                 for k in set(low_kinds) | set(high_kinds)}
    kinds = {k: low_kinds.get(k, 0.0) + per_block[k] * (layers - low.layers) for k in per_block}
    flops = low.flops + (high.flops - low.flops) / (high.layers - low.layers) * (layers - low.layers)
    return Traced(layers, low.world, ({k: v for k, v in sorted(kinds.items()) if v > 0},), flops)


def trace(fields: dict, work: Workload, world: int, layers: int | None = None) -> Traced:
    """Trace one step at `layers` blocks (default: the config's) on `world` fake ranks."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layers = layers or fields["num_hidden_layers"]
    if dist.is_initialized():
        raise RuntimeError("plan traces on a fake process group of its own: call it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside fake mode: it reads its ranks
        with FakeTensorMode():
            tracker, flops = tracked_step(fields, work, mesh, _timeline_tracker(), layers)
    finally:
        dist.destroy_process_group()
    return Traced(layers, world, candidate_moments(tracker.moments), flops)


def tracked_step(fields: dict, work: Workload, mesh, tracker_class, layers: int | None = None):
    """Build the model, lay it out over `mesh` as `work` says and train one step under `tracker_class` (an
    FSDPMemTracker) with AdamW's state made first: (the tracker, the step's FLOPs). On fake tensors for the
    plan; on real ones to check it."""
    import torch

    from torchfleet.plan import library_model

    model = library_model.build(fields, layers)
    _prepare(model, work, mesh)
    # One parameter at a time: torchtitan's fused AdamW makes no temporaries the size of the model, and the
    # foreach form (which does) is not what a GPU run's peak would hold. (fused=True here counts every
    # parameter's state unsharded under fake tensors.)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, fields["vocab_size"], (work.local_batch, work.seq + 1))
    _make_optimizer_state(model, optimizer)
    tracker = tracker_class(model, optimizer)
    tracker.track_inputs((tokens,))
    with tracker, flop_counter() as counter:
        _step(model, optimizer, tokens)
    return tracker, counter.total


def traced_at_scale(fields: dict, work: Workload, world: int) -> Traced:
    """The full model's peak on `world` ranks: traced directly when shallow, else carried from the deepest
    two of three or more small depths once their growth per block agrees (the same moment is the peak)."""
    layers = fields["num_hidden_layers"]
    if layers <= TRACE_DEPTHS[-1] + 2:
        return _cached(fields, work, TRACE_WORLD, layers).at_world(world)
    depths = list(TRACE_DEPTHS) + [TRACE_DEPTHS[-1] + 2]
    while True:
        a, b, c = (_cached(fields, work, TRACE_WORLD, d).at_world(world) for d in depths[-3:])
        first, second = (b.peak - a.peak) / (b.layers - a.layers), (c.peak - b.peak) / (c.layers - b.layers)
        if abs(second - first) <= 0.01 * abs(second) or depths[-1] + 2 >= layers:
            return at_depth(b, c, layers)
        depths.append(depths[-1] + 2)


def _cached(fields: dict, work: Workload, world: int, layers: int) -> Traced:
    return _trace_cached(_Frozen(fields), work, world, layers)


class _Frozen(dict):
    """A config's fields, hashable by content, so one process traces each depth once."""

    def __hash__(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return hash(repr(sorted(self.items())))


@functools.lru_cache(maxsize=32)
def _trace_cached(fields: _Frozen, work: Workload, world: int, layers: int) -> Traced:
    return trace(dict(fields), work, world, layers)


def _prepare(model, work: Workload, mesh) -> None:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchfleet.plan import library_model

    blocks = library_model.blocks(model)
    if work.ac != "none":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(blocks):
            if work.ac == "selective":
                blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=selective_contexts)
            else:
                blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if work.precision == "bf16" else MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def flop_counter():
    """A dispatch mode summing torch's FLOP formulas (torch.utils.flop_counter's table) over every operator it
    sees, with the CPU's fused attention added, which that table leaves out: the same products as the GPU's
    kernels (full, not causal-halved, as torch counts those). Unlike FlopCounterMode it tracks no modules, so
    the memory tracker beside it sees the step exactly as it would alone; `.total` after the step."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import (
        flop_registry,
        sdpa_backward_flop_count,
        sdpa_flop_count,
        shape_wrapper,
    )

    aten = torch.ops.aten
    table = dict(flop_registry)

    def heads_of(q, kv):
        # Grouped key/value heads (enable_gqa) count as the query's heads, as the kernels broadcast them;
        # torch before 2.14 counts only equal head counts.
        return (kv[0], q[1], *kv[2:])

    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        table[aten._scaled_dot_product_flash_attention_for_cpu] = shape_wrapper(
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, heads_of(q, k), heads_of(q, v)))
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        table[aten._scaled_dot_product_flash_attention_for_cpu_backward] = shape_wrapper(
            lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(
                grad, q, heads_of(q, k), heads_of(q, v)))

    class FlopSum(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            formula = table.get(func._overloadpacket)
            if formula is not None:
                self.total += formula(*args, **(kwargs or {}), out_val=out)
            return out

    return FlopSum()


def _make_optimizer_state(model, optimizer) -> None:
    """AdamW's state, made before tracing, so that one traced step holds it as every later step does."""
    import torch

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _timeline_tracker():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Timeline(FSDPMemTracker):
        """FSDPMemTracker that also keeps, after every operator, the memory by kind at that moment."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.moments: list[dict[str, float]] = []

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            kinds: dict[str, float] = {}
            for device in self._curr_mem_snap.values():
                for kind, nbytes in device.items():
                    name = str(kind).split(".")[-1]
                    if name != "Total" and nbytes:
                        kinds[name] = kinds.get(name, 0.0) + nbytes
            self.moments.append(kinds)

    return Timeline


def _step(model, optimizer, tokens) -> None:
    import torch.nn.functional as F

    # No key/value cache: a cache the blocks append to would differ between forward and recomputation.
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def selective_contexts():
    """torchtitan's operator-level policy: keep attention's output and every other matrix product's."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.max.default}
    for name in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            keep.add(getattr(aten, name).default)
    products = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            products[phase] += 1
        if func in keep and not (func == aten.mm.default and products[phase] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
