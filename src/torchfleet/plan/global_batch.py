"""How each `plan --hf-config` row reaches its global batch: samples a GPU runs at once, passes a step, and
the data-parallel GPUs that share the batch.

Without `--global-batch`, every row runs `--local-batch` samples on each data-parallel GPU, so its global
batch grows with them (torchtitan's tables are laid out so). With it, every row trains that global batch:
each of the d data-parallel GPUs (replicas x shards, or every GPU under fsdp+ep) takes G / d samples a step,
run as forward-and-backward passes of at most `--local-batch` samples each (gradient accumulation), or, in a
pipeline, as micro-batches of one sample. A row whose d does not divide G cannot train it and is left out,
with a note.

Gradient accumulation as torchtitan runs it under FSDP2: each pass gathers the parameters and reduce-scatters
its gradients, so a step's compute and collectives are the pass's times the passes, and from the second pass
on every GPU holds its whole shard of fp32 gradients from the first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchfleet.plan.traced import Traced


@dataclass(frozen=True)
class Reach:
    local: int  # samples a GPU runs at once (a pipeline's micro-batch)
    passes: int  # forward-and-backward passes a step: gradient accumulation, or a pipeline's micro-batches
    dp: int  # data-parallel GPUs sharing the global batch

    @property
    def global_batch(self) -> int:
        return self.local * self.passes * self.dp

    @property
    def per_gpu(self) -> int:
        """Samples a data-parallel GPU trains a step."""
        return self.local * self.passes

    def describe(self) -> str:
        return f"{self.local} x {self.passes} x {self.dp}"


def reach(global_batch: int | None, local_batch: int, dp: int, microbatch: int | None = None) -> Reach | None:
    """How `dp` data-parallel GPUs reach `global_batch` (None: `local_batch` each, in one pass, or in micro-batches
    of `microbatch` samples under a pipeline); None when they cannot share it evenly."""
    per_gpu = local_batch if global_batch is None else global_batch // dp
    if global_batch is not None and (global_batch % dp or per_gpu < 1):
        return None
    if microbatch is not None:
        return Reach(microbatch, max(1, per_gpu // microbatch), dp) if per_gpu % microbatch == 0 else None
    local = max(d for d in range(1, min(local_batch, per_gpu) + 1) if per_gpu % d == 0)
    return Reach(local, per_gpu // local, dp)


def accumulating(traced: Traced, sharded_grad_bytes: float, passes: int) -> Traced:
    """`traced` (one pass) as a step of `passes` holds it: the shard's fp32 gradients from the earlier passes alive
    at every moment of the last one."""
    if passes == 1:
        return traced
    moments = tuple({**m, "SHARDED_GRAD": max(m.get("SHARDED_GRAD", 0.0), sharded_grad_bytes)} for m in traced.moments)
    return replace(traced, moments=moments)


def left_out(layout: str, dp: int, global_batch: int) -> str:
    return f"{layout} left out: its {dp:,} data-parallel GPUs cannot share a global batch of {global_batch:,} evenly"
