"""What a collective hidden behind compute still costs the step: the compute it overlaps runs slower.

A collective that overlaps compute (FSDP's prefetched all-gathers and its reduce-scatters, HSDP's all-reduce
across replicas, DDP's bucketed all-reduces) adds no time of its own to the step, but it shares the GPU with
the kernels it hides behind: NCCL's kernels hold SMs (a block a channel) and read and write HBM, and a matrix
product whose grid no longer fits the SMs left in one wave runs a tail. Lee et al. measured that slowdown
("Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning: Performance and
Power Implications", 2025, arXiv 2507.03114): over GPT and Llama training on 4 A100s, 4 H100s, MI250s and
MI210s, compute overlapped with communication ran 18.9% slower on average (40.0% at most) than with no
communication beside it.

The plan takes that average for every GPU kind: each second of communication hidden behind compute makes
the compute it overlaps SLOWDOWN seconds longer. Collectives that wait between two products (tensor
parallelism's, expert parallelism's all-to-alls, a pipeline's sends) overlap nothing and cost their own
time instead. Between CPU processes the question is whether a core is free, not this (plan/predict.py).
"""

from __future__ import annotations

SLOWDOWN = 0.189


def slowed_s(hidden_s: float) -> float:
    """The seconds `hidden_s` of communication overlapped with compute add to that compute."""
    return SLOWDOWN * max(0.0, hidden_s)
