"""The central promise: ddp computes what serial computes at the same global batch."""

import pytest

from torchfleet import launch
from torchfleet.testing import train_k_steps, train_matrix

CASES = [
    {"model": "mlp", "optimizer": "sgd", "grad_accum": 1},
    {"model": "mlp", "optimizer": "adamw", "grad_accum": 1, "lr": 1e-3},
    {"model": "mlp", "optimizer": "sgd", "grad_accum": 2},
    {"model": "cnn", "optimizer": "adamw", "grad_accum": 2, "lr": 1e-3},
    {"model": "mlp", "optimizer": "sgd", "grad_accum": 1, "loader_first": True},
]


@pytest.mark.timeout(180)
def test_ddp_two_processes_match_serial():
    serial = [train_k_steps("serial", steps=6, **case) for case in CASES]
    ddp = launch(train_matrix, nprocs=2, args=("ddp", [dict(case, steps=6) for case in CASES]))
    rank0 = ddp[0]
    assert ddp[1] == [None] * len(CASES)  # only the main rank reports weights
    for case, want, got in zip(CASES, serial, rank0, strict=True):
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff < 1e-5, f"{case}: max weight difference {diff:.3g}"
        # Training moved the weights: equal-because-untouched would prove nothing.
        untouched = train_k_steps("serial", steps=1, **dict(case, lr=1e-12))
        assert (got - untouched).abs().max().item() > 1e-3


def test_accumulation_changes_nothing_but_memory():
    plain = train_k_steps("serial", steps=4, grad_accum=1)
    accumulated = train_k_steps("serial", steps=4, grad_accum=4)
    assert (plain - accumulated).abs().max().item() < 1e-5


@pytest.mark.timeout(180)
def test_one_launched_process_keeps_ddp_and_fsdp_in_a_group_of_one(tmp_path):
    """`torchrun -n 1` (or launch(nprocs=1)) with ddp or fsdp: the wrapper over a group of one,
    as torch runs it, so one GPU exercises NCCL, DDP and FSDP2 (tests/test_cuda.py); serial's weights."""
    import torch

    from torchfleet.testing import resumed_equals_straight
    from torchfleet.testing_devices import fleet_facts, trained_facts

    serial = train_k_steps("serial")
    for strategy, wrapper in (("ddp", "DistributedDataParallel"), ("fsdp", "FSDPSequential")):
        ((facts, got),) = launch(trained_facts, nprocs=1, args=(strategy,))
        assert (facts["strategy"], facts["group"], facts["wrapper"]) == (strategy, 1, wrapper)
        assert torch.equal(got, serial)  # an average over one rank is the rank's own gradient
    # fsdp's checkpoint of one shard (torch.distributed.checkpoint) resumes to the straight run
    ((straight, resumed),) = launch(resumed_equals_straight, nprocs=1, args=("fsdp", str(tmp_path / "ckpt")))
    assert torch.equal(straight, resumed)
    # Nothing to split a model over: a pipeline of one process runs serial, and says so.
    (facts,) = launch(fleet_facts, nprocs=1, args=("pipeline",))
    assert (facts["strategy"], facts["group"]) == ("serial", 0)
