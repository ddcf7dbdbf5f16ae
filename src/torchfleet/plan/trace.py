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
all-gather and reduce-scatter buffers. The same pass counts the step's FLOPs
(plan/step_counter.py).
On one H200 (torch 2.11) the tracker's peak matched max_memory_allocated within
0.1% in 4 of 5 Llama-shaped cells; traced here on the CPU, a 1B shape's peak is
within 0.3% of a real H100's and its FLOPs equal the H100's count
(docs/benchmarks/history.md).

Tracing costs time per operator, so deep models are traced at three or more
small depths and the figures carried to the full depth (plan/traced.py).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, replace

from torchfleet.plan import checkpoint_policy, tensor_parallel
from torchfleet.plan.step_counter import step_counter
from torchfleet.plan.traced import Traced, at_depth, candidate_moments
from torchfleet.strategies.registry import DP_SHARD, TP

AC_MODES = ("none", "selective", "full")
TRACE_DEPTHS = (2, 4)  # decoder blocks traced first; deeper models are carried from these and deeper ones
TRACE_WORLD = 8  # ranks traced; other worlds scale the sharded kinds (Traced.at_world)


@dataclass(frozen=True)
class Workload:
    seq: int
    local_batch: int
    ac: str = "selective"
    precision: str = "bf16"
    tp: int = 1  # tensor-parallel ranks (plan/tensor_parallel.py); FSDP shards over the rest
    # FSDP2 frees each block's gathered parameters after its forward; a pipeline stage keeps them for its
    # micro-batches' backward instead (torchtitan's default under pp), and gathers once a step.
    reshard_after_forward: bool = True
    # Which part of the model a pipeline stage holds (library_model.STAGES): "whole" outside pipelines.
    stage: str = "whole"
    decoder_seq: int | None = None  # an encoder-decoder's decoder tokens a sample; None: seq
    attention: str = "fused"  # kernels.ATTENTION: "eager" traces transformers' math path
    compiled: tuple[str, ...] = ()  # what torch.compile fuses (plan/kernels.py's COMPILE_COMPONENTS)


def trace(fields: dict, work: Workload, world: int, layers: int | None = None) -> Traced:
    """Trace one step at `layers` blocks (default: the config's) on `world` FSDP ranks x `work.tp` fake ranks."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layers = layers or fields["num_hidden_layers"]
    if dist.is_initialized():
        raise RuntimeError("plan traces on a fake process group of its own: call it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world * work.tp)
    try:
        mesh = _mesh(world, work.tp)  # outside fake mode: it reads its ranks
        with tensor_parallel.traceable(), FakeTensorMode():
            tracker, counter = tracked_step(fields, work, mesh, _timeline_tracker(), layers)
    finally:
        dist.destroy_process_group()
    return Traced(
        layers,
        world,
        candidate_moments(tracker.moments),
        counter.total,
        tuple((kind, nbytes, counter.calls[kind]) for kind, nbytes in sorted(counter.collectives.items())),
        tracker.held,
        tuple(counter.work.items()),
    )


def _mesh(world: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (world, tp), mesh_dim_names=(DP_SHARD, TP))


def tracked_step(fields: dict, work: Workload, mesh, tracker_class, layers: int | None = None):
    """Build the model, lay it out over `mesh` as `work` says and train one step under `tracker_class` (an
    FSDPMemTracker) with AdamW's state made first: (the tracker, the step's counter of FLOPs and tensor-parallel
    collectives). On fake tensors for the plan; on real ones to check it."""
    import torch

    from torchfleet.plan import compiled, flash_attention, library_model

    model = library_model.build(fields, layers)
    shape = library_model.kind(fields)
    if work.attention == "eager":  # the scores materialised, as a run without fused attention holds them
        model.set_attn_implementation("eager")
    else:
        flash_attention.use(model)  # attention as a GPU's fused kernels hold it, for every variant
    compiled.use(model, work.compiled)
    if work.stage != "whole":
        library_model.keep_stage(model, work.stage)
    _prepare(model, fields, work, mesh)
    # One parameter at a time: torchtitan's fused AdamW makes no temporaries the size of the model, and the
    # foreach form (which does) is not what a GPU run's peak would hold. (fused=True here counts every
    # parameter's state unsharded under fake tensors.)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, fields["vocab_size"], (work.local_batch, work.seq + 1))
    hidden = None
    if work.stage in ("middle", "last"):  # the previous stage's output, as the send between them delivers it
        dtype = torch.bfloat16 if work.precision == "bf16" else torch.float32
        hidden = torch.randn(work.local_batch, work.seq, fields["hidden_size"], dtype=dtype, requires_grad=True)
    written = None  # an encoder-decoder's decoder's tokens, and the targets after them
    if shape == "encoder-decoder":
        written = torch.randint(0, fields["vocab_size"], (work.local_batch, (work.decoder_seq or work.seq) + 1))
    _make_optimizer_state(model, optimizer)
    tracker = tracker_class(model, optimizer)
    tracker.track_inputs(tuple(t for t in (tokens, hidden, written) if t is not None))
    with tracker, step_counter() as counter, warnings.catch_warnings():
        # A stage without the output layer returns a view of its blocks' output; the step does nothing in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        _step(
            model,
            optimizer,
            tokens,
            work.tp,
            hidden,
            last=work.stage in ("whole", "last"),
            after_forward=lambda: _note_held(tracker),
            decoder=written,
            encoder=shape == "encoder",
            fused_loss="loss" in work.compiled,
        )
    return tracker, counter


def _note_held(tracker) -> None:
    """At the end of forward: the activations and inputs alive, what the micro-batch holds until its backward
    (the timeline's last moment; nothing for a tracker that keeps no timeline)."""
    moments = getattr(tracker, "moments", None)
    if moments:
        tracker.held = moments[-1].get("ACT", 0.0) + moments[-1].get("INP", 0.0)


def traced_at_scale(fields: dict, work: Workload, world: int) -> Traced:
    """The full model's peak on `world` FSDP ranks (x work.tp): traced directly when shallow, else carried from the deepest
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


@functools.lru_cache(maxsize=128)
def _trace_cached(fields: _Frozen, work: Workload, world: int, layers: int) -> Traced:
    if work.compiled and work.tp > 1:  # held as eager's (plan/compiled.py)
        return _trace_cached(fields, replace(work, compiled=()), world, layers)
    traced = trace(dict(fields), work, world, layers)
    if work.compiled:
        # What a compiled step holds is its fused operators' (plan/compiled.py); what it costs is the eager
        # operators' under kernels.py's rule for compile, which prices fusion by operator.
        eager = _trace_cached(fields, replace(work, compiled=()), world, layers)
        traced = replace(traced, flops=eager.flops, collectives=eager.collectives, work=eager.work)
    return traced


def _prepare(model, fields: dict, work: Workload, mesh) -> None:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchfleet.plan import library_model

    if work.tp > 1:  # split first, then checkpoint and shard the split blocks, as torchtitan orders them
        tensor_parallel.apply(model, fields, mesh[TP])
        mesh = mesh[DP_SHARD]
    lists = library_model.block_lists(model)
    if work.ac != "none":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for blocks in lists:
            for i, block in enumerate(blocks):
                if work.ac == "selective":
                    blocks[i] = checkpoint_wrapper(
                        block, preserve_rng_state=False, context_fn=checkpoint_policy.selective_contexts
                    )
                else:
                    blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if work.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in (block for blocks in lists for block in blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=work.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=work.reshard_after_forward)


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
            self.held = 0.0  # what a micro-batch's forward leaves for its backward (_note_held)

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


def _step(
    model,
    optimizer,
    tokens,
    tp: int = 1,
    hidden=None,
    last: bool = True,
    after_forward=None,
    decoder=None,
    encoder: bool = False,
    fused_loss: bool = False,
) -> None:
    """One step: from the tokens (or a pipeline stage's input `hidden`) to the loss, or to the output whose
    gradient the next stage sends back (not `last`); `after_forward` is called between the two passes. An
    encoder-decoder's decoder writes the `decoder` tokens, predicting each next one; an encoder (masked language model) predicts every
    position and takes no cache flag."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    # No key/value cache: a cache the blocks append to would differ between forward and recomputation.
    given = {"input_ids": tokens[:, :-1]} if hidden is None else {"inputs_embeds": hidden}
    targets = tokens[:, 1:]
    if decoder is not None:  # an encoder-decoder: the encoder reads the tokens, the decoder writes its own
        given["decoder_input_ids"] = decoder[:, :-1]
        targets = decoder[:, 1:]
    out = model(**given, use_cache=False).logits if decoder is not None or not encoder else model(**given).logits
    with loss_parallel() if tp > 1 and last else contextlib.nullcontext():  # on the vocabulary's shards
        if not last:
            loss = None
        elif fused_loss and tp == 1:
            from torchfleet.plan import compiled

            loss = compiled.cross_entropy(out.flatten(0, 1), targets.flatten())
        else:
            loss = F.cross_entropy(out.flatten(0, 1).float(), targets.flatten())
        if after_forward is not None:
            after_forward()
        if loss is None:
            out.backward(torch.ones_like(out))  # the gradient arriving from the next stage
        else:
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
