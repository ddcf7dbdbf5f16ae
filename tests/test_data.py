"""What fleet.dataloader yields: one batch taken for example_inputs changes nothing; a checkpoint's position resumes."""

import torch

from torchfleet.data import GlobalBatchSampler
from torchfleet.fleet import Fleet
from torchfleet.train.datasets import synthetic


def test_a_batch_taken_for_example_inputs_leaves_the_epoch_whole():
    fleet = Fleet("serial")
    data = synthetic(256, shape=(1, 8, 8), seed=1)
    loader = fleet.dataloader(data, 32, shuffle=True, seed=2)
    example = next(iter(loader))[0]  # the README's way to get example_inputs for a pipeline
    epoch = [x for x, _ in loader]
    untouched = [x for x, _ in fleet.dataloader(data, 32, shuffle=True, seed=2)]
    assert len(epoch) == len(untouched) == 8  # batch 0 is not skipped
    assert all(torch.equal(a, b) for a, b in zip(epoch, untouched, strict=True))
    assert torch.equal(example, epoch[0])
    second = [x for x, _ in loader]  # a finished pass moves on to the next epoch's order
    assert len(second) == 8 and not torch.equal(second[0], epoch[0])


def test_a_loaded_position_resumes_mid_epoch_once():
    straight = list(GlobalBatchSampler(100, 10, shuffle=True, seed=0))
    stopped = GlobalBatchSampler(100, 10, shuffle=True, seed=0)
    it = iter(stopped)
    for _ in range(3):
        next(it)
    state = stopped.state_dict()
    assert state == {"epoch": 0, "position": 3, "seed": 0}
    resumed = GlobalBatchSampler(100, 10, shuffle=True, seed=0)
    resumed.load_state_dict(state)
    assert list(resumed) == straight[3:]  # the checkpoint's position, then the rest of the epoch
    assert resumed.epoch == 1 and resumed.position == 0
