"""The central promise: ddp computes what serial computes at the same global batch."""

import pytest

from torchfleet import launch
from torchfleet.testing.equivalence import train_k_steps, train_matrix

CASES = [
    {"model": "mlp", "optimizer": "sgd", "grad_accum": 1},
    {"model": "mlp", "optimizer": "adamw", "grad_accum": 1, "lr": 1e-3},
    {"model": "mlp", "optimizer": "sgd", "grad_accum": 2},
    {"model": "cnn", "optimizer": "adamw", "grad_accum": 2, "lr": 1e-3},
    {"model": "mlp", "optimizer": "sgd", "grad_accum": 1, "loader_first": True},
]


def _micro_batches(local_batch: int, case: dict, steps: int) -> list[int]:
    """The forwards one rank runs: each step's share cut into grad_accum equal micro-batches."""
    accum = case["grad_accum"]
    return [local_batch // accum] * (steps * accum)


@pytest.mark.timeout(180)
def test_ddp_two_processes_match_serial():
    serial = []
    for case in CASES:
        forwards: list[int] = []
        serial.append(train_k_steps("serial", steps=6, forwards=forwards, **case))
        # Equal weights alone would not show accumulation: one unsplit step computes the same.
        assert forwards == _micro_batches(32, case, 6), f"serial {case}: forward batch sizes {forwards}"
    ddp = launch(train_matrix, nprocs=2, args=("ddp", [dict(case, steps=6) for case in CASES]))
    assert [w for w, _ in ddp[1]] == [None] * len(CASES)  # only the main rank reports weights
    for rank, jobs in enumerate(ddp):
        for case, (_, forwards) in zip(CASES, jobs, strict=True):
            assert forwards == _micro_batches(16, case, 6), f"ddp rank {rank} {case}: forward batch sizes {forwards}"
    for case, want, (got, _) in zip(CASES, serial, ddp[0], strict=True):
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff < 1e-5, f"{case}: max weight difference {diff:.3g}"
        # Training moved the weights: equal-because-untouched would prove nothing.
        untouched = train_k_steps("serial", steps=1, **dict(case, lr=1e-12))
        assert (got - untouched).abs().max().item() > 1e-3


def test_accumulation_changes_nothing_but_memory():
    plain_forwards: list[int] = []
    accumulated_forwards: list[int] = []
    plain = train_k_steps("serial", steps=4, grad_accum=1, forwards=plain_forwards)
    accumulated = train_k_steps("serial", steps=4, grad_accum=4, forwards=accumulated_forwards)
    assert (plain - accumulated).abs().max().item() < 1e-5
    # ...and the accumulated run did split: 4 forwards of 8 per step, not one of 32.
    assert plain_forwards == [32] * 4
    assert accumulated_forwards == [8] * 16, f"grad_accum=4: forward batch sizes {accumulated_forwards}"


@pytest.mark.timeout(180)
def test_one_launched_process_keeps_ddp_and_fsdp_in_a_group_of_one(tmp_path):
    """`torchrun -n 1` (or launch(nprocs=1)) with ddp or fsdp: the wrapper over a group of one,
    as torch runs it, so one GPU exercises NCCL, DDP and FSDP2 (tests/test_cuda.py); serial's weights."""
    import torch

    from torchfleet.testing.devices import fleet_facts, trained_facts
    from torchfleet.testing.equivalence import resumed_equals_straight

    # Serial's weights from a launched process too, as the others are, not from pytest's own: in two full CI
    # runs this test's serial in pytest's process differed from the launched ones in the last bits (3.7e-9),
    # passing alone; the thread count was the same (tests/conftest.py holds it), the cause not yet found.
    (serial,) = launch(train_k_steps, nprocs=1, args=("serial",))
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
