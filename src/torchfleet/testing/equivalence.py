"""Reference jobs for equivalence checks: train K steps of a small model, return the weights.

Used by the test suite and the benchmarks, and handy for users checking
their own set-up: on any strategy that computes what `serial` computes, the
weights returned here must match serial's within float tolerance.
Functions here are module-level so `launch` can start them in new processes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from torchfleet.data import GlobalBatchSampler
from torchfleet.errors import UsageError
from torchfleet.fleet import Fleet
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import build_model, build_optimizer


def train_k_steps(
    strategy: str,
    model: str = "mlp",
    optimizer: str = "sgd",
    steps: int = 5,
    batch_size: int = 32,
    grad_accum: int = 1,
    seed: int = 0,
    lr: float = 0.05,
    precision: str = "fp32",
    loader_first: bool = False,
    forwards: list[int] | None = None,
    **strategy_options,
) -> torch.Tensor | None:
    """Weights after `steps` optimizer steps on synthetic data (None on ranks without them).

    `loader_first` builds the data loader before `fleet.setup`, as many scripts do.
    `forwards`, when given, gets the batch size of each forward of the model on this rank:
    equal weights cannot show that `grad_accum` split the batch, since an accumulated
    step computes what one big step computes.
    The process group stays up afterwards, so several jobs can share one launch.
    """
    fleet = Fleet(strategy=strategy, precision=precision, grad_accum=grad_accum, **strategy_options)
    torch.manual_seed(seed)
    data = synthetic(batch_size * steps, shape=(1, 8, 8), seed=seed)
    if loader_first:
        loader = fleet.dataloader(data, batch_size, shuffle=True, seed=seed)
    net = build_model(model, (1, 8, 8), 10)
    if forwards is not None:  # on the model itself: the strategy's wrapper calls it once per micro-batch
        net.register_forward_pre_hook(lambda _module, args: forwards.append(len(args[0])))
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


def train_matrix(strategy: str, cases: list[dict]) -> list[tuple[torch.Tensor | None, list[int]]]:
    """Several `train_k_steps` jobs in one set of processes (one launch, many checks).

    Each job gives (its weights, the batch size of each forward on this rank).
    """
    results = []
    for case in cases:
        forwards: list[int] = []
        results.append((train_k_steps(strategy, forwards=forwards, **case), forwards))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # see Fleet.close: tear down together
        torch.distributed.destroy_process_group()
    return results


def dropout_mlp() -> nn.Module:
    """A small model whose training draws random numbers (dropout), for resume checks."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))


def resume_job(strategy: str, directory: str) -> list:
    """`resumed_equals_straight` through file and sharded checkpoints, in one set of processes."""
    results = [
        resumed_equals_straight(strategy, f"{directory}/{layout}", sharded=layout == "sharded")
        for layout in ("full", "sharded")
    ]
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return results


def resumed_equals_straight(
    strategy: str,
    directory: str,
    steps: int = 8,
    stop_at: int = 3,
    sharded: bool | None = None,
    batch_size: int = 16,
    seed: int = 0,
    **strategy_options,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
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
    assert isinstance(loader, DataLoader)  # map-style data: fleet.dataloader's DataLoader, not a stream's
    run(loader, 0, stop_at)
    path = f"{directory}/step-{stop_at:08d}"
    assert isinstance(loader.batch_sampler, GlobalBatchSampler)  # fleet.dataloader's, which has a state
    fleet.save(path, sharded=sharded, step=stop_at, sampler=loader.batch_sampler.state_dict())
    loader = start(seed + 1)  # other weights, other RNG: the checkpoint must restore both
    assert isinstance(loader, DataLoader)
    extra = fleet.load(path)
    assert isinstance(loader.batch_sampler, GlobalBatchSampler)
    loader.batch_sampler.load_state_dict(extra["sampler"])
    run(loader, extra["step"], steps)
    return straight, full_weights(fleet)


class WithUnusedHead(nn.Module):
    """A model whose forward leaves one module unused, as library models leave a pooler."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 10)
        self.pooler = nn.Linear(10, 10)  # never called

    def forward(self, x):
        return self.body(x.flatten(1))


def default_microbatches_job() -> tuple[int, dict[int, int]]:
    """(threads per process, {conv kernel: micro-batches chosen}) for a pipeline's batch of 32."""
    chosen = {}
    for kernel in (1, 3):
        fleet = Fleet(strategy="pipeline")
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(3, 8, kernel, padding=kernel // 2),
            nn.ReLU(),
            nn.Conv2d(8, 8, kernel, padding=kernel // 2),
            nn.Flatten(),
            nn.Linear(128, 10),
        )
        fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        fleet.train_step(torch.randn(32, 3, 4, 4), torch.randint(0, 10, (32,)), nn.functional.cross_entropy)
        from torchfleet.strategies.pipeline.strategy import Pipeline

        assert isinstance(fleet.strategy, Pipeline)
        chosen[kernel] = fleet.strategy.microbatches
    torch.distributed.barrier()  # see Fleet.close: tear down together
    torch.distributed.destroy_process_group()
    return torch.get_num_threads(), chosen


def misuse_job(kind: str, **options) -> str | None:
    """The UsageError a misuse gives (its message), or None when the job trains.

    kinds: "unused" (a ddp model with an unused module), "hand-written" (fleet.backward
    under a pipeline).
    """

    strategy = "ddp" if kind == "unused" else "pipeline"
    # (under a pipeline the stage itself refuses a call from outside the schedule)
    fleet = Fleet(strategy=strategy, **options)
    torch.manual_seed(0)
    net = WithUnusedHead() if kind == "unused" else build_model("mlp", (1, 8, 8), 10)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = fleet.setup(net, opt)
    data = synthetic(32, shape=(1, 8, 8))
    message = None
    try:
        for inputs, targets in fleet.dataloader(data, 16):
            if kind == "hand-written":
                fleet.backward(nn.functional.cross_entropy(model(inputs), targets))
            else:
                fleet.train_step(inputs, targets, nn.functional.cross_entropy)
    except UsageError as error:
        message = str(error)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return message
