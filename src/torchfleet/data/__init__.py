"""The samplers behind `fleet.dataloader`: why the batch size is global.

`GlobalBatchSampler` is why results do not depend on the process count: the
epoch's permutation is cut into global batches first, and each data-parallel
rank takes its contiguous slice of every global batch. The union over ranks of
step k is exactly the batch a single process would see at step k.

The package's other modules: stream.py cuts a stream (an IterableDataset) the
same way in its own order; token_shards.py and text_records.py are the data
sets behind `train --data PATH` (docs/guides/data.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate

from torchfleet.errors import UsageError


class DataError(UsageError):
    """Bad data found while reading it (a shard that is empty, cut short or holds a token outside the vocabulary,
    a document too long): one sentence naming the file and the offset or record."""


class TensorBatches(Dataset):
    """A TensorDataset that hands a DataLoader whole batches: one gather per tensor.

    DataLoader calls `__getitems__` with a batch's indices when a dataset has
    it; collate with `as_batch`. The batch holds the same samples in the same
    order as the default per-sample fetch and stack (so training is bit for bit
    the same), in about a sixth of the time for small samples, which is a
    measurable share of a small model's step (docs/benchmarks/history.md).
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
        # Where the next pass over the loader begins: a loaded checkpoint's position, else 0.
        # Kept apart from `position` so that an iterator left mid-epoch (next(iter(loader))
        # to get example inputs) does not make the next pass skip what it handed out.
        self._start = 0
        self._seeked = False  # a `seek` not yet taken up by the pass under way

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = self._start = 0
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
        start, self._start = self._start, 0
        self.position, epoch, self._seeked = start, self.epoch, False
        order = self._order().tolist()
        # The position is read afresh for every batch: `seek` during the pass (a replica group's
        # step that did not commit, or a group that healed) moves this very iterator.
        while self.position < len(self):
            if self._seeked:
                self._seeked = False
                if self.epoch != epoch:  # moved to another epoch: the next pass starts there
                    return
                self._start = 0  # taken up by this pass, not a later one
            step = self.position
            first = step * self.global_batch
            chunk = order[first : first + self.global_batch]
            # An incomplete last batch (drop_last=False) is split as evenly as it goes.
            per_rank = -(-len(chunk) // self.world_size)
            mine = chunk[self.rank * per_rank : (self.rank + 1) * per_rank]
            self.position = step + 1
            yield mine
        if self._seeked and self.epoch != epoch:  # moved at the last batch: the next pass starts there
            self._seeked = False
            return
        self._seeked = False
        self.position = 0
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self._start = self.position

    def seek(self, step: int) -> None:
        """Go to the batch of global step `step` (counted from the first epoch's first batch): a replica
        group redoing a step that did not commit, or going on where its peers are. A pass under way
        hands that batch out next (within its epoch; at another epoch it ends); else the next pass
        starts there."""
        self.epoch, self.position = divmod(step, len(self))
        self._start, self._seeked = self.position, True


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


def dataset_length(dataset, method: str) -> int:
    """The data set's length, after refusing what is not a data set of known length."""
    if isinstance(dataset, DataLoader):
        raise UsageError(
            f"fleet.{method} takes a Dataset, not a DataLoader: it builds the loader itself,"
            " giving each process its share of every batch; pass the loader's .dataset"
        )
    if not isinstance(dataset, Sized):
        raise UsageError(
            f"fleet.{method} splits a data set by index and needs its length; {type(dataset).__name__} has no __len__"
        )
    return len(dataset)


def check_accumulation(global_batch: int, world_size: int, grad_accum: int) -> None:
    """Each process's share of the global batch must split into the accumulation's micro-steps."""
    local = global_batch // world_size
    if local % grad_accum:
        raise UsageError(
            f"each process's batch of {local} (batch size {global_batch} / {world_size}"
            f" processes) does not split into {grad_accum} accumulation steps;"
            f" use a batch size that is a multiple of {world_size * grad_accum}"
        )


class Collate:
    """`transform` on each sample, then `collate_fn` (torch's default_collate when None) on the batch; picklable,
    so it runs in a loader's worker processes whatever their start method."""

    def __init__(self, transform: Callable | None = None, collate_fn: Callable | None = None):
        self.transform, self.collate_fn = transform, collate_fn or default_collate

    @property
    def default(self) -> bool:
        return self.transform is None and self.collate_fn is default_collate

    def __call__(self, samples: list):
        return self.collate_fn(samples if self.transform is None else [self.transform(s) for s in samples])


def batch_loader(
    dataset: Dataset, sampler: GlobalBatchSampler, seed: int, num_workers: int = 0, collate: Collate | None = None
) -> DataLoader:
    """The DataLoader `fleet.dataloader` returns: `sampler`'s batches of `dataset`, through `collate`."""
    collate = collate or Collate()
    # Its own generator: each new iterator draws a seed from it, and a draw from
    # the global RNG there would shift dropout after a mid-epoch resume.
    generator = torch.Generator().manual_seed(seed)
    if type(dataset) is TensorDataset and collate.default:
        # In-memory tensors: gather each batch at once instead of sample by sample.
        return DataLoader(
            TensorBatches(dataset),
            batch_sampler=sampler,
            num_workers=num_workers,
            collate_fn=as_batch,
            generator=generator,
        )
    # A data set whose `__getitems__` returns a whole batch, not torch's list of samples (TokenShards,
    # `gathers_batches = True`): its batch is ready as it comes.
    collate_fn = as_batch if collate.default and getattr(dataset, "gathers_batches", False) else collate
    return DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_fn, generator=generator
    )
