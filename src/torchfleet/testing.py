"""Reference jobs for equivalence checks: train K steps, return the weights.

Used by the test suite and the benchmarks, and handy for users checking
their own set-up: on any strategy that computes what `serial` computes, the
weights returned here must match serial's within float tolerance.
Functions here are module-level so `launch` can start them in new processes.
"""

from __future__ import annotations

import torch
from torch import nn

from torchfleet.fleet import Fleet
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import build_model, build_optimizer


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().cpu().flatten() for p in model.state_dict().values()])


def train_k_steps(strategy: str, model: str = "mlp", optimizer: str = "sgd", steps: int = 5,
                  batch_size: int = 32, grad_accum: int = 1, seed: int = 0, lr: float = 0.05,
                  precision: str = "fp32", loader_first: bool = False,
                  **strategy_options) -> torch.Tensor | None:
    """Weights after `steps` optimizer steps on synthetic data (None on ranks without them).

    `loader_first` builds the data loader before `fleet.setup`, as many scripts do.
    The process group stays up afterwards, so several jobs can share one launch.
    """
    fleet = Fleet(strategy=strategy, precision=precision, grad_accum=grad_accum, **strategy_options)
    torch.manual_seed(seed)
    data = synthetic(batch_size * steps, shape=(1, 8, 8), seed=seed)
    if loader_first:
        loader = fleet.dataloader(data, batch_size, shuffle=True, seed=seed)
    net = build_model(model, (1, 8, 8), 10)
    opt = build_optimizer(optimizer, net.parameters(), lr)
    fleet.setup(net, opt)
    if not loader_first:
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


def dropout_mlp() -> nn.Module:
    """A small model whose training draws random numbers (dropout), for resume checks."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))


def resume_job(strategy: str, directory: str) -> list:
    """`resumed_equals_straight` through file and sharded checkpoints, in one set of processes."""
    results = [resumed_equals_straight(strategy, f"{directory}/{layout}", sharded=layout == "sharded")
               for layout in ("full", "sharded")]
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return results


def resumed_equals_straight(strategy: str, directory: str, steps: int = 8, stop_at: int = 3,
                            sharded: bool | None = None, batch_size: int = 16, seed: int = 0,
                            **strategy_options) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weights after `steps` straight, weights after stopping at `stop_at` and resuming).

    The resumed half starts from a different model, optimizer and RNG state,
    so it matches only if the checkpoint restored all of them. The model has
    dropout, so the RNG states count. Both on the main rank, None elsewhere.
    """
    fleet = Fleet(strategy=strategy, **strategy_options)
    data = synthetic(batch_size * 5, shape=(1, 8, 8), seed=seed)  # steps span epochs

    def start(init_seed: int):
        torch.manual_seed(init_seed)
        net = dropout_mlp()
        fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        return fleet.dataloader(data, batch_size, shuffle=True, seed=seed)

    def run(loader, step: int, until: int) -> int:
        while step < until:
            for inputs, targets in loader:
                fleet.train_step(inputs, targets, nn.functional.cross_entropy)
                step += 1
                if step == until:
                    break
        return step

    run(start(seed), 0, steps)
    straight = full_weights(fleet)
    loader = start(seed)
    run(loader, 0, stop_at)
    path = f"{directory}/step-{stop_at:08d}"
    fleet.save(path, sharded=sharded, step=stop_at, sampler=loader.batch_sampler.state_dict())
    loader = start(seed + 1)  # other weights, other RNG: the checkpoint must restore both
    extra = fleet.load(path)
    loader.batch_sampler.load_state_dict(extra["sampler"])
    run(loader, extra["step"], steps)
    return straight, full_weights(fleet)
