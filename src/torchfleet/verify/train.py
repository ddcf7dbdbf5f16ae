"""One case of `torchfleet verify`: a model trained a few SGD steps under one strategy, its weights kept.

`train_case` is what the test suite's zoo (tests/zoo.py) runs for every library model and strategy, and what
`verify` runs for the user's: the model built after seed 0 on every rank, an optimizer over its trainable
parameters (as a fine-tuning script builds it), each data-parallel rank its rows of every global batch, the
weights gathered on the main rank as the strategy's checkpoint holds them. `matrix` runs several cases in
one set of processes; `reordered` is serial with float order changed on purpose (the rounding floor).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch import nn

from torchfleet.strategies import registry

Batch = Callable[[int, int], tuple]  # (rows, seed) -> (inputs, targets)


def rows(batch: tuple, rank: int, world: int) -> tuple:
    """This data rank's rows of a global batch, as fleet.dataloader would give them."""
    inputs, targets = batch
    per = len(targets) // world
    part = slice(rank * per, (rank + 1) * per)
    inputs = {k: v[part] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[part]
    return inputs, targets[part]


def train_case(
    strategy: str,
    build: Callable[[], nn.Module],
    batch: Batch,
    loss_fn: Callable,
    steps: int = 5,
    batch_size: int = 8,
    lr: float = 1e-2,
    save_to: str | None = None,
    memory: bool = False,
    adapters_to: str | None = None,
    **fleet_options,
) -> dict | None:
    """The model `build` makes after `steps` SGD steps under `strategy`, as the main rank reports it.

    {"weights": {name: tensor}, "notes": fleet.notes, "memory": the strategy's memory report (with `memory`),
    "seconds": setup and steps}, or {"refused": the sentence} when setup or a step refuses the job; None on
    the other ranks. `save_to` also writes ``fleet.save_model`` there, `adapters_to` its adapters-only save.
    """
    from torchfleet import Fleet
    from torchfleet.errors import UsageError

    fleet = None
    began = time.perf_counter()
    try:
        fleet = Fleet(strategy=strategy, **fleet_options)
        torch.manual_seed(0)
        net = build()
        optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr)
        batches = [batch(batch_size, seed) for seed in range(steps)]
        share = fleet.strategy.data_coords()
        fleet.setup(net, optimizer, example_inputs=rows(batches[0], *share)[0])
        for one in batches:
            inputs, targets = rows(one, *share)
            fleet.train_step(inputs, targets, loss_fn)
        if save_to:
            fleet.save_model(save_to)
        if adapters_to:
            fleet.save_model(adapters_to, adapters_only=True)
        state, _ = fleet.strategy.state_dicts()
        report = fleet.strategy.memory_report() if memory else None
    except UsageError as error:  # every rank refuses alike, before training
        return {"refused": str(error)} if fleet is None or fleet.is_main else None
    if not fleet.is_main:
        return None
    return {
        "weights": {k: v.detach().float().cpu().clone() for k, v in state.items()},
        "notes": list(fleet.notes),
        "memory": report,
        "seconds": time.perf_counter() - began,
    }


def matrix(cases: list[tuple[str, Callable[[], tuple], dict]]) -> list:
    """`train_case` for each (strategy, parts, options) in one set of processes; parts() gives (build, batch,
    loss_fn) and is called in each process, so the model is built there."""
    results = []
    for strategy, parts, options in cases:
        build, batch, loss_fn = parts()
        results.append(train_case(strategy, build, batch, loss_fn, **options))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return results


def _halves(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` with its products summed over the two halves of its input features, then added."""
    half = layer.in_features // 2
    out = nn.functional.linear(x[..., :half], layer.weight[:, :half])
    out = out + nn.functional.linear(x[..., half:], layer.weight[:, half:])
    return out if layer.bias is None else out + layer.bias


@contextlib.contextmanager
def summed_in_halves():
    """Every plain nn.Linear's product summed in two halves while inside: serial with another float order."""
    original = nn.Linear.forward

    def forward(self, x):
        return _halves(self, x) if self.in_features >= 2 else original(self, x)

    nn.Linear.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.forward = original  # type: ignore[method-assign]


def reordered(build: Callable[[], nn.Module], batch: Batch, loss_fn: Callable, **options) -> dict | None:
    """Serial's case with every linear layer's products summed in two halves (summed_in_halves)."""
    with summed_in_halves():
        return train_case(registry.REFERENCE, build, batch, loss_fn, **options)


def max_difference(want: dict, got: dict) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    if list(got) != list(want):
        raise AssertionError(f"the weights' keys differ: {sorted(set(got) ^ set(want))[:5]}")
    return max(((want[k] - got[k]).abs().max().item() for k in want), default=0.0)
