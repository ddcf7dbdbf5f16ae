"""Reference jobs about devices and precisions, beside testing/equivalence.py's (used by the GPU suite too).

The CPU run a GPU run is compared with, the device and backend a Fleet picks,
and fp16 training with one overflowing step. Module-level, so `launch` can
start them in new processes.
"""

from __future__ import annotations

import torch
from torch import nn

from torchfleet.fleet import Fleet
from torchfleet.strategies import registry
from torchfleet.testing.equivalence import full_weights, train_k_steps
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import build_model


def on_cpu(fn, *args):
    """`fn(*args)` in a fresh process that sees no GPU: the CPU run a GPU run is compared with.

    The child is spawned with CUDA_VISIBLE_DEVICES empty, so torch there finds
    no device and every Fleet in it picks the CPU, whatever this process holds.
    """
    import multiprocessing
    import os

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read by the child at its start
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(fn, args)
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def fleet_facts(strategy: str, **options) -> dict:
    """What a Fleet picks here (one per rank): device, backend and its reason, the strategy it
    runs, the process group's size (0: none) and the class of the model it trains (its wrapper)."""
    fleet = Fleet(strategy=strategy, **options)
    facts = {
        "device": str(fleet.device),
        "backend": fleet.backend,
        "reason": fleet.backend_reason,
        "strategy": fleet.strategy_name,
        "group": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 0,
    }
    net = build_model("mlp", (1, 8, 8), 10)
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    facts["wrapper"] = type(fleet.strategy.model).__name__
    if torch.distributed.is_initialized():
        fleet.close()
    return facts


def trained_facts(strategy: str, **options) -> tuple[dict, torch.Tensor | None]:
    """(`fleet_facts`, `train_k_steps`'s weights) from one set of processes: one launch, not two."""
    weights = train_k_steps(strategy, **options)  # leaves the process group up for the facts
    return fleet_facts(strategy, **options), weights


def fp16_skip_job(
    strategy: str = registry.REFERENCE,
    options: dict | None = None,
    steps: int = 5,
    poisoned: int = 3,
    fp16_on_cpu: bool = False,
) -> dict:
    """fp16 training where the last rank's step `poisoned` (counted from 1) overflows.

    Under ddp an inf goes into that rank's input and DDP's all-reduce spreads it;
    elsewhere one element of the rank's own gradients becomes inf after any
    reduction (fsdp's shards and a pipeline's stages differ per rank, so only a
    shared verdict makes the other ranks skip too). `fp16_on_cpu` lets fp16 run
    on a CPU, for machines without a GPU. {"device", "scales": the scaler's scale
    after each step, "weights": before and after each step}.
    """
    from torchfleet import precision

    if fp16_on_cpu:
        precision.FP16_DEVICES = ("cuda", "cpu")
    fleet = Fleet(strategy=strategy, precision="fp16", **(options or {}))
    torch.manual_seed(0)
    net = build_model("mlp", (1, 8, 8), 10)
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    prec, step = fleet.strategy.runtime.precision, [0]
    assert prec.scaler is not None  # fp16's loss scaler, whose scale this job records
    poisons = fleet.rank == fleet.world_size - 1
    original = prec.step

    def step_with_poison(optimizer):
        if step[0] == poisoned and poisons:
            grad = next(p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # fsdp's grads are DTensors
            local.view(-1)[0] = float("inf")
        original(optimizer)

    if strategy != "ddp":
        prec.step = step_with_poison
    scales, weights = [], [full_weights(fleet)]
    for x, y in fleet.dataloader(synthetic(32 * steps, seed=1), 32, seed=1):
        step[0] += 1
        if strategy == "ddp" and step[0] == poisoned and poisons:
            x = x.clone()
            x[0, 0, 0, 0] = float("inf")  # an overflow in this rank's forward: DDP's all-reduce spreads it
        fleet.train_step(x, y, nn.CrossEntropyLoss())
        scales.append(prec.scaler.get_scale())
        weights.append(full_weights(fleet))
    fleet.close()
    return {"device": str(fleet.device), "scales": scales, "weights": weights}
