"""Fleet.dataloader's whole-batch gather gives exactly the default DataLoader's batches."""

import torch
from torch.utils.data import DataLoader

from torchfleet.data import GlobalBatchSampler, TensorBatches, digits, synthetic
from torchfleet.fleet import Fleet


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
