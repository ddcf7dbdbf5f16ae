"""The step `plan` profiles and traces: bench's model, batch and loss on this CPU, and the optimizers it names."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if name == "sgd" else 0.0)


def workload(spec: dict, batch: int):
    """bench's model, inputs, targets and loss for `spec` at `batch` samples, on this CPU (as rank 0)."""
    from torchfleet.bench.measure_cell import workload as bench_workload

    host = SimpleNamespace(device=torch.device("cpu"), to_device=lambda t: t)
    return bench_workload(spec, batch, 0, host)  # pyright: ignore[reportArgumentType] (only device and to_device are read)


def train_step(model, optimizer, inputs, targets, loss_fn) -> None:
    optimizer.zero_grad(set_to_none=True)
    output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    loss_fn(output, targets).backward()
    optimizer.step()
