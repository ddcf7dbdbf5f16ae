"""Reference jobs for equivalence checks: train K steps, return the weights.

Used by the test suite and the benchmarks, and handy for users checking
their own set-up: on any strategy that computes what `serial` computes, the
weights returned here must match serial's within float tolerance.
Functions here are module-level so `launch` can start them in new processes.
"""

from __future__ import annotations

import torch
from torch import nn

from torchfleet.data import synthetic
from torchfleet.fleet import Fleet
from torchfleet.models import build_model
from torchfleet.trainer import build_optimizer


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().cpu().flatten() for p in model.state_dict().values()])


def train_k_steps(strategy: str, model: str = "mlp", optimizer: str = "sgd", steps: int = 5,
                  batch_size: int = 32, grad_accum: int = 1, seed: int = 0, lr: float = 0.05,
                  precision: str = "fp32", **strategy_options) -> torch.Tensor | None:
    """Weights after `steps` optimizer steps on synthetic data (None on ranks without them).

    The process group stays up afterwards, so several jobs can share one launch.
    """
    fleet = Fleet(strategy=strategy, precision=precision, grad_accum=grad_accum, **strategy_options)
    torch.manual_seed(seed)
    data = synthetic(batch_size * steps, shape=(1, 8, 8), seed=seed)
    net = build_model(model, (1, 8, 8), 10)
    opt = build_optimizer(optimizer, net.parameters(), lr)
    fleet.setup(net, opt)
    loader = fleet.dataloader(data, batch_size, shuffle=True, seed=seed)
    loss_fn = nn.CrossEntropyLoss()
    for inputs, targets in loader:
        fleet.train_step(inputs, targets, loss_fn)
    return full_weights(fleet)


def full_weights(fleet: Fleet) -> torch.Tensor | None:
    """The whole model's weights on the main rank (sharding strategies gather in state_dicts)."""
    state, _ = fleet.strategy.state_dicts()
    if not fleet.is_main or not state:
        return None
    return torch.cat([t.detach().float().cpu().flatten() for t in state.values()])


def train_matrix(strategy: str, cases: list[dict]) -> list[torch.Tensor | None]:
    """Several `train_k_steps` jobs in one set of processes (one launch, many checks)."""
    results = [train_k_steps(strategy, **case) for case in cases]
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # see Fleet.close: tear down together
        torch.distributed.destroy_process_group()
    return results
