"""The hot path is as fast as hand-written code and computes exactly what it computes.

benchmarks/parity.py measures the speed; these check the "exactly": the
whole-batch gather against DataLoader's per-sample fetch, and train_step
against a hand-written loop, bit for bit.
"""

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader

from torchfleet.data import GlobalBatchSampler, TensorBatches
from torchfleet.fleet import Fleet
from torchfleet.train.datasets import digits, synthetic
from torchfleet.train.models import cnn


def test_whole_batch_gather_equals_per_sample_fetch():
    fleet = Fleet("serial")
    for data in (synthetic(1000, shape=(1, 8, 8), seed=3), digits("val")):
        fast = fleet.dataloader(data, 64, shuffle=True, seed=5)
        assert isinstance(fast.dataset, TensorBatches)
        slow = DataLoader(data, batch_sampler=GlobalBatchSampler(len(data), 64, 0, 1, True, 5))
        pairs = list(zip(fast, slow, strict=True))
        assert len(pairs) == len(data) // 64
        for (x, y), (x_ref, y_ref) in pairs:
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)  # same samples, same order
            assert x.dtype == x_ref.dtype and y.dtype == y_ref.dtype and x.is_contiguous()


def test_other_datasets_keep_the_default_fetch():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.tensor([float(i * i)]), i

    loader = Fleet("serial").dataloader(Squares(), 5, shuffle=False)
    assert [y.tolist() for _, y in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_train_step_equals_a_hand_written_loop_bit_for_bit():
    torch.manual_seed(0)
    initial = cnn()
    data = synthetic(6 * 32, seed=1)
    loss_fn = nn.CrossEntropyLoss()

    hand = copy.deepcopy(initial)
    opt = torch.optim.SGD(hand.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in DataLoader(data, batch_size=32):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(hand(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    fleet = Fleet("serial")
    model = copy.deepcopy(initial)
    fleet.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    got = [fleet.train_step(x, y, loss_fn) for x, y in fleet.dataloader(data, 32, shuffle=False)]
    assert all(torch.equal(a, b) for a, b in zip(got, losses, strict=True))
    for (name, a), b in zip(hand.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
