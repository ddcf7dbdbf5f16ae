"""A mixture-of-experts model's figures for `torchfleet plan`, and what expert parallelism costs over them.

The experts are the modules expert parallelism itself splits (strategies/expert_parallel.py's
`find_experts`: weights stacking one matrix per expert). One forward of the profiled batch counts, at
each such module, the (token, choice) rows it is called with and their width: the rows an ep rank sends
to the experts' ranks and gets back. Per experts' layer a step runs two all-to-alls of those rows
forward (dispatch, combine) and their two reverses in backward, each rank sending (ep - 1) / ep of its
rows away, and one small all-to-all of the counts per expert before the dispatch.

What ep changes in memory: the experts' parameters, gradients and optimizer state are split over ep
(and under fsdp+ep sharded by FSDP2 over the dp / ep groups as well, so 1 / dp in all, as fsdp's);
the rest is held as ddp (ep: FSDP2 replicating it) or fsdp (fsdp+ep) holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchfleet.plan import comm

# Forward's dispatch and combine, and the gradients' way back through each in backward.
ALL_TO_ALLS_PER_LAYER = 4
COUNT_BYTES = 8  # one int64 count per expert, sent before each dispatch


@dataclass(frozen=True)
class ExpertShape:
    experts: int = 0  # experts per layer (0: the model has none)
    layers: int = 0  # modules holding experts
    parameters: int = 0  # their parameters, summed over the layers
    routed_bytes_per_sample: float = 0.0  # one all-to-all's rows a sample, summed over the layers


def measure(model: nn.Module, inputs, batch: int) -> ExpertShape:
    """The experts of `model` and the rows one forward of `inputs` (`batch` samples) routes to them."""
    from torchfleet.strategies.expert_parallel import find_experts

    found = find_experts(model)
    if not found:
        return ExpertShape()
    routed: list[float] = []

    def count(_module, args) -> None:
        hidden, chosen = args[0], args[1]  # (hidden_states [T, H], top_k_index [T, k], top_k_weights)
        routed.append(chosen.numel() * hidden.shape[-1] * hidden.element_size())

    handles = [module.register_forward_pre_hook(count) for _, module in found]
    try:
        with torch.no_grad():
            model(**inputs) if isinstance(inputs, dict) else model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return ExpertShape(
        experts=next(found[0][1].parameters(recurse=False)).shape[0],
        layers=len(found),
        parameters=sum(p.numel() for _, module in found for p in module.parameters()),
        routed_bytes_per_sample=sum(routed) / max(1, batch),
    )


def held(parameters: float, experts: float, shard: int, ep: int) -> float:
    """Parameters a rank holds: the rest over FSDP2's shards, the experts over ep, or over the shards where
    those are more (fsdp+ep shards each ep rank's experts over the dp / ep groups)."""
    return (parameters - experts) / shard + experts / max(ep, shard)


def step_all_to_all_s(routed_bytes: float, experts: int, layers: int, ep: int, link: comm.Link) -> float:
    """Seconds of a step's all-to-alls on one rank: `routed_bytes`, one all-to-all's rows over every layer,
    moved ALL_TO_ALLS_PER_LAYER times, and each dispatch's counts; every call pays its messages' latency."""
    if ep <= 1 or layers == 0:
        return 0.0
    rows = ALL_TO_ALLS_PER_LAYER * layers * comm.all_to_all_s(routed_bytes / layers, ep, link)
    return rows + layers * comm.all_to_all_s(experts * COUNT_BYTES, ep, link)
