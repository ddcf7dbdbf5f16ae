"""Streams in `fleet.dataloader`: an IterableDataset shared by the ranks and their workers, resumed exactly.

The global order is the stream's own: sample i is the i-th record it yields.
Global batch k is samples [kB, (k+1)B), and rank r's share of it is the
contiguous slice [kB + rb, kB + (r+1)b) with b = B / world, as
GlobalBatchSampler cuts a map-style epoch: the union over ranks of step k is
the batch one process would see at step k, whatever the number of processes.

A stream can only be read in order, so every reader (each loader worker of
each rank) reads the records and keeps its own, as Hugging Face's
`split_dataset_by_node` does when the shards do not divide among the nodes.
What costs per sample, `transform` (tokenizing, decoding) and collating, runs
once per sample in the whole job, in the worker that keeps it. Worker w of a
rank's W builds the rank's batches of steps s+w, s+w+W, ..., because a
DataLoader takes its workers' items round robin.

The position is global: global batches consumed in this epoch and, when the
stream has `state_dict`/`load_state_dict` (a Hugging Face IterableDataset,
train's TextRecords), its state just after the last of them, taken by the
worker that built it. A resume loads that state, or reads past the samples
consumed when the stream keeps none; either way it goes on at the same
sample on any number of processes and workers.
"""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from torchfleet.data import DataError, check_accumulation, check_global_batch
from torchfleet.errors import UsageError


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is read in order (an IterableDataset: torch's, or Hugging Face's, which subclasses it)."""
    return isinstance(dataset, IterableDataset)


def _stateful(source: Any) -> bool:
    return callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))


def _records(source: Any) -> Iterator:
    """`source`'s records in order, all of them, in any process.

    A Hugging Face IterableDataset iterated inside a DataLoader worker gives
    that worker only some of its shards (and none to a worker beyond the shard
    count); its public `.iter(batch_size=1)` does not split, so every reader
    sees the whole stream and keeps its own samples here."""
    if type(source).__module__.startswith("datasets.") and callable(getattr(source, "iter", None)):
        for batch in source.iter(batch_size=1):
            yield {key: column[0] for key, column in batch.items()}
    else:
        yield from source


class StreamShare(IterableDataset):
    """One rank's share of a stream, cut into its local batches; runs in each loader worker (or the rank)."""

    def __init__(self, source, global_batch: int, rank: int, world: int, transform=None, collate_fn=None):
        self.source, self.global_batch = source, global_batch
        self.rank, self.local_batch = rank, global_batch // world
        self.transform: Callable = transform or _unchanged  # a module's function: picklable for spawned workers
        self.collate_fn: Callable = collate_fn or default_collate
        self.start: tuple[int, int, Any] = (0, 0, None)  # (epoch, first step, the stream's state there)

    def __iter__(self) -> Iterator[tuple[int, Any, Any]]:
        """(step, this rank's batch of it, the stream's state after it); at the stream's end (step, None,
        the samples it held), or (-1, None, a sentence) for bad input found here."""
        try:
            yield from self._batches()
        # Exception, then isinstance: a generator left open is closed at exit, when UsageError may be None.
        except Exception as exc:
            if not isinstance(exc, UsageError):
                raise
            yield -1, None, str(exc)  # one sentence for the user, not a worker's wrapped traceback

    def _batches(self) -> Iterator[tuple[int, Any, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, first, state = self.start
        # A worker reads its own copy; in the rank's process a copy too, so that a state loaded for
        # one pass (Hugging Face keeps it as the start of every later pass) stays with that pass.
        source = self.source if info is not None else copy.copy(self.source)
        if callable(getattr(source, "set_epoch", None)):
            source.set_epoch(epoch)  # a shuffled stream's order for this pass, the same in every reader
        stateful = _stateful(source)
        skip = first * self.global_batch
        if state is not None and stateful:
            source.load_state_dict(state)
            skip = 0
        records = _records(source)
        seen = first * self.global_batch - skip
        for _ in range(skip):  # no state to load: read past what was consumed
            if next(records, _END) is _END:
                yield first, None, seen
                return
            seen += 1
        low, high = self.rank * self.local_batch, (self.rank + 1) * self.local_batch
        step = first
        while True:
            mine = (step - first) % workers == worker
            kept = []
            for j in range(self.global_batch):
                record = next(records, _END)
                if record is _END:
                    yield step, None, seen
                    return
                seen += 1
                if mine and low <= j < high:
                    kept.append(record)
            if mine:
                batch = self.collate_fn([self.transform(r) for r in kept])
                yield step, batch, source.state_dict() if stateful else None
            step += 1


_END = object()


def _unchanged(sample):
    return sample


def _worker_context(num_workers: int) -> str | None:
    """Fork the loader's workers from the rank itself where the platform can. A worker leaves when its parent
    does (torch's worker loop watches its parent's pid); a rank started by the launcher's forkserver would
    otherwise start its workers from a forkserver of its own, which outlives a rank killed with SIGKILL: the
    orphaned worker then lived on, holding the job's output open (seen: a killed run's command never returned)."""
    if num_workers == 0 or "fork" not in multiprocessing.get_all_start_methods():
        return None
    return "fork"


class StreamLoader:
    """What `fleet.dataloader` returns for a stream: this rank's batches, and the stream's position.

    Iterate it as a DataLoader. `state_dict()` goes into a checkpoint and
    `load_state_dict()` makes the next pass start where it stopped; `len()` is
    the steps of an epoch when the stream knows its length. A pass that ends
    starts the next epoch from the stream's beginning.
    """

    def __init__(self, share: StreamShare, num_workers: int = 0, seed: int = 0):
        self.share, self.num_workers, self.seed = share, num_workers, seed
        self.global_batch, self.local_batch = share.global_batch, share.local_batch
        self.epoch = 0
        self.position = 0  # global batches of this epoch consumed
        self.stream_state: Any = None  # the stream's own state after them, when it keeps one
        # Where the next pass begins; kept apart from `position` so that a batch taken for example
        # inputs (next(iter(loader))) does not make the next pass skip it (as GlobalBatchSampler).
        self._start: tuple[int, Any] = (0, None)

    def __len__(self) -> int:
        if not hasattr(self.share.source, "__len__"):
            raise TypeError(f"{type(self.share.source).__name__} has no length: a stream's steps are counted as read")
        return len(self.share.source) // self.global_batch

    def __iter__(self) -> Iterator:
        (start, state), self._start = self._start, (0, None)
        epoch = self.epoch
        self.position, self.stream_state = start, state
        self.share.start = (epoch, start, state)
        # Its own generator: a DataLoader draws its workers' base seed from one, and a draw from
        # the global RNG would shift dropout after a resume.
        loader = DataLoader(
            self.share,
            batch_size=None,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
            multiprocessing_context=_worker_context(self.num_workers),
        )
        for step, batch, after in loader:
            if batch is None:
                if isinstance(after, str):
                    raise DataError(after)
                if step == 0:
                    raise UsageError(
                        f"the stream ended after {after} samples, before its first global batch of"
                        f" {self.global_batch}; use a batch size of at most {after} or give it more samples"
                    )
                break
            self.position, self.stream_state = step + 1, after
            yield batch
        self.position, self.stream_state, self.epoch = 0, None, epoch + 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples": self.position * self.global_batch, "stream": self.stream_state}

    def load_state_dict(self, state: dict) -> None:
        steps, rest = divmod(state["samples"], self.global_batch)
        if rest:
            raise UsageError(
                f"the checkpoint's stream position, {state['samples']} samples, is not a whole number of"
                f" global batches of {self.global_batch}; resume with the batch size it was saved with"
            )
        self.epoch, self.position, self.stream_state = state["epoch"], steps, state["stream"]
        self._start = (steps, state["stream"])


def stream_loader(
    dataset,
    batch_size: int,
    rank: int,
    world: int,
    grad_accum: int,
    replica_groups: bool,
    num_workers: int,
    seed: int,
    transform=None,
    collate_fn=None,
) -> StreamLoader:
    """`fleet.dataloader` for a stream: the batch checked as for map-style data, this rank's loader made."""
    if replica_groups:
        raise UsageError(
            "a stream cannot be read under replica groups (--fault-tolerance step): a group that heals"
            " goes back or forward to its peers' batch, which a stream read in order cannot do; use a"
            " map-style data set (token shards are one: torchfleet.data.TokenShards)"
        )
    check_global_batch(batch_size, world)
    check_accumulation(batch_size, world, grad_accum)
    if num_workers < 0:
        raise UsageError(f"num_workers {num_workers} must be 0 (read in the training process) or more")
    if hasattr(dataset, "__len__") and len(dataset) < batch_size:  # known now: said before any process reads
        raise UsageError(
            f"the stream holds {len(dataset)} samples, fewer than one global batch of {batch_size};"
            f" use a batch size of at most {len(dataset)} or give it more samples"
        )
    return StreamLoader(StreamShare(dataset, batch_size, rank, world, transform, collate_fn), num_workers, seed)
