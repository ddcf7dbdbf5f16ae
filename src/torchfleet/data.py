"""Built-in data and the sampler that makes the batch size global.

`digits` is real data shipped inside scikit-learn (1,797 8x8 hand-written
digits), so the built-in job needs no download. `synthetic` is random data of
any shape, and `MockLoader` yields one batch held in memory forever, as the
benchmark notebook in the project's seeds does, so that loading is not timed.

`GlobalBatchSampler` is why results do not depend on the process count: the
epoch's permutation is cut into global batches first, and each data-parallel
rank takes its contiguous slice of every global batch. The union over ranks of
step k is exactly the batch a single process would see at step k.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, Sampler, TensorDataset

from torchfleet.errors import UsageError

DATASETS = ("digits", "synthetic")


def digits(split: str = "train", val_fraction: float = 0.2, seed: int = 0) -> TensorDataset:
    """scikit-learn's digits as (N, 1, 8, 8) floats in [0, 1] and int64 labels.

    The train/validation split is a fixed permutation of `seed`, the same on
    every rank and every run.
    """
    from sklearn.datasets import load_digits  # imported here: sklearn is slow to import

    if split not in ("train", "val"):
        raise UsageError(f"unknown split {split!r}; choose train or val")
    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(raw.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * val_fraction)
    idx = order[:n_val] if split == "val" else order[n_val:]
    return TensorDataset(images[idx], labels[idx])


def synthetic(
    size: int,
    shape: tuple[int, ...] = (1, 8, 8),
    num_classes: int = 10,
    seed: int = 0,
    split: str = "train",
) -> TensorDataset:
    """Random inputs of `shape` with labels from a fixed random linear rule.

    The labels depend on the inputs, so a model can learn them and the loss
    falls: that makes the data useful for tests as well as timing. The rule
    depends on `seed` alone; the validation split draws other inputs.
    """
    if size < 1:
        raise UsageError(f"synthetic data size {size} must be at least 1")
    rule_gen = torch.Generator().manual_seed(seed)
    rule = torch.randn((int(torch.Size(shape).numel()), num_classes), generator=rule_gen)
    input_gen = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
    inputs = torch.rand((size, *shape), generator=input_gen)
    labels = (inputs.flatten(1) @ rule).argmax(dim=1)
    return TensorDataset(inputs, labels)


class MockLoader:
    """One batch, made once and yielded forever (the seed notebook's MockLoader).

    Benchmarks use it so the figures measure training, not data loading.
    """

    def __init__(self, shape: tuple[int, ...], num_classes: int = 10, device="cpu", seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.rand(shape, generator=gen).to(device)
        self.targets = torch.randint(0, num_classes, (shape[0],), generator=gen).to(device)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.inputs, self.targets


class TensorBatches(Dataset):
    """A TensorDataset that hands a DataLoader whole batches: one gather per tensor.

    DataLoader calls `__getitems__` with a batch's indices when a dataset has
    it; collate with `as_batch`. The batch holds the same samples in the same
    order as the default per-sample fetch and stack (so training is bit for bit
    the same), in about a sixth of the time for small samples, which is a
    measurable share of a small model's step (docs/benchmarks.md).
    """

    def __init__(self, dataset: TensorDataset):
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]):
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[index] for t in self.tensors)


def as_batch(batch):
    """The collate function for TensorBatches: the batch is already whole."""
    return batch


class GlobalBatchSampler(Sampler[list[int]]):
    """Batches of indices for one data-parallel rank, cut from global batches.

    Each epoch is a permutation seeded by (seed, epoch). With drop_last the
    final incomplete global batch is dropped on every rank, so all ranks run
    the same number of steps and every step averages equal-sized shards.
    The sampler's position is part of a checkpoint, so a resumed run
    continues at the exact batch where it stopped.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        check_global_batch(global_batch, world_size)
        if dataset_len < global_batch and drop_last:
            raise UsageError(
                f"batch size {global_batch} is larger than the data set ({dataset_len} samples);"
                f" use at most {dataset_len}"
            )
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.local_batch = global_batch // world_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        gen = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        return torch.randperm(self.dataset_len, generator=gen)

    def __len__(self) -> int:
        full, rest = divmod(self.dataset_len, self.global_batch)
        return full if self.drop_last or rest == 0 else full + 1

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order().tolist()
        for step in range(self.position, len(self)):
            start = step * self.global_batch
            chunk = order[start : start + self.global_batch]
            # An incomplete last batch (drop_last=False) is split as evenly as it goes.
            per_rank = -(-len(chunk) // self.world_size)
            mine = chunk[self.rank * per_rank : (self.rank + 1) * per_rank]
            self.position = step + 1
            yield mine
        self.position = 0
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]


class ShardSampler(Sampler[int]):
    """Every index exactly once across ranks, strided; for evaluation."""

    def __init__(self, dataset_len: int, rank: int = 0, world_size: int = 1):
        self.indices = list(range(rank, dataset_len, world_size))

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


def check_global_batch(global_batch: int, world_size: int) -> None:
    """The global batch must split evenly among the data-parallel ranks."""
    if global_batch < 1:
        raise UsageError(f"batch size {global_batch} must be at least 1")
    if global_batch < world_size:
        raise UsageError(
            f"batch size {global_batch} is smaller than the {world_size} processes sharing it;"
            f" use at least {world_size}"
        )
    if global_batch % world_size:
        lower = global_batch - global_batch % world_size
        raise UsageError(
            f"batch size {global_batch} does not split evenly among {world_size} processes;"
            f" use a multiple of {world_size} such as {lower} or {lower + world_size}"
        )


def builtin_dataset(name: str, split: str, seed: int = 0, size: int = 4096,
                    shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10) -> Dataset:
    """The dataset `torchfleet train --data NAME` uses."""
    if name == "digits":
        return digits(split, seed=seed)
    if name == "synthetic":
        n = size if split == "train" else max(1, size // 5)
        return synthetic(n, shape, num_classes, seed=seed, split=split)
    raise UsageError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
