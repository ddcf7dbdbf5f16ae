"""Token shards: a directory of token files, memory-mapped, read as windows of sequence+1 tokens.

The files are nanoGPT's ``.bin`` (raw tokens, uint16 as its prepare.py
writes them; ``dtype="uint32"`` for vocabularies past 65,536) and numpy's
``.npy`` (1-D, uint16 or uint32, the dtype read from the header), taken in
sorted name order. Window i of a file is its tokens [i*seq, i*seq + seq + 1):
the first seq are the input, the last seq the target, so consecutive windows
share one token and no token is a target twice. Windows stay inside one file.

It is a map-style data set, so `fleet.dataloader`'s GlobalBatchSampler does
the rest: windows in an order fixed by the seed and epoch, each global batch
shared among the ranks, the position in the checkpoint, and a resume on any
number of processes going on with the same windows. Nothing is read until a
batch asks for it: each process maps the files and copies only its windows.

``eos=ID`` packs documents: the files hold documents separated by that token,
``position_ids`` restart at 0 after each one (the packed-sequence convention
of transformers' DataCollatorWithFlattening), and the target after an
end-of-document token is -100, so no document is asked to predict the next.
The inputs are then ``{"input_ids", "position_ids"}``. A model that takes
position_ids (transformers' models) sees each document from position 0; with
a varlen attention kernel (flash attention) it also attends within documents
only. The built-in gpt takes no position_ids.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from torchfleet.data import DataError
from torchfleet.errors import UsageError

SUFFIXES = (".bin", ".npy")
DTYPES = ("uint16", "uint32")


def token_files(path: str | os.PathLike, split: str | None = None) -> list[Path]:
    """The token files at `path` (a file, or a directory's .bin and .npy files in name order). `split`: "val"
    keeps the files whose names start with "val", "train" the others, None all."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"token shards {str(path)!r} do not exist; give a directory of .bin or .npy token files")
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
    if not files:
        raise DataError(f"directory {str(path)!r} holds no token files; put .bin (nanoGPT) or .npy token files in it")
    if split is not None:
        files = [f for f in files if f.name.startswith("val") == (split == "val")]
    return files


def _open(file: Path, dtype: str) -> np.ndarray:
    """`file`'s tokens, memory-mapped (nothing read yet), after checking that it is a token file."""
    if file.suffix == ".npy":
        try:
            tokens = np.load(file, mmap_mode="r")
        except (ValueError, OSError, EOFError) as exc:
            raise DataError(f"token shard {str(file)!r} is not a readable .npy file ({exc})") from None
        if tokens.ndim != 1 or tokens.dtype.name not in DTYPES:
            raise DataError(
                f"token shard {str(file)!r} holds a {tokens.ndim}-D array of {tokens.dtype.name}; token shards are"
                f" 1-D arrays of {' or '.join(DTYPES)}"
            )
        return tokens
    size, width = file.stat().st_size, np.dtype(dtype).itemsize
    if size % width:
        raise DataError(
            f"token shard {str(file)!r} has {size} bytes, not a whole number of {dtype} tokens of {width} bytes:"
            " it was cut short or is not a token file"
        )
    if size == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses an empty file; refused by the caller in words
    return np.memmap(file, dtype=dtype, mode="r")


class TokenShards(Dataset):
    """Windows of `seq_len` + 1 tokens from the token files at `path` (see the module doc).

    `vocab_size`: every batch's tokens are checked against it, and a token at or above it stops the run
    with the file and offset named (a DataError: exit status 2 under `train`), never an index error
    deep in an embedding. `split`: "train" or "val" by file name (token_files), None for every file.
    """

    gathers_batches = True  # __getitems__ returns the whole batch (data/__init__.py's batch_loader)

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        vocab_size: int | None = None,
        dtype: str = "uint16",
        eos: int | None = None,
        split: str | None = None,
    ):
        if seq_len < 1:
            raise UsageError(f"sequence length {seq_len} must be at least 1")
        if dtype not in DTYPES:
            raise UsageError(f"token dtype {dtype!r} is not one; use {' or '.join(DTYPES)}")
        self.files = token_files(path, split)
        self.seq_len, self.vocab_size, self.dtype, self.eos = seq_len, vocab_size, dtype, eos
        counts = []
        for file in self.files:
            tokens = len(_open(file, dtype))
            if tokens == 0:
                raise DataError(f"token shard {str(file)!r} is empty; remove it or write its tokens again")
            counts.append(max(0, (tokens - 1) // seq_len))  # each window also needs the token after it
        if sum(counts) == 0:
            raise DataError(
                f"the token shards at {str(path)!r} hold no window of {seq_len + 1} tokens (the sequence and"
                " its next token); give more tokens or a shorter sequence"
            )
        self.starts = np.cumsum([0, *counts]).tolist()  # window index where each file begins
        self._maps: list[np.ndarray] = []
        self._pid = -1

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict:  # to a loader worker: paths, not mapped arrays (numpy would copy them whole)
        return {**self.__dict__, "_maps": [], "_pid": -1}

    def _mapped(self) -> list[np.ndarray]:
        if self._pid != os.getpid():  # mapped once in each process that reads
            self._maps, self._pid = [_open(f, self.dtype) for f in self.files], os.getpid()
        return self._maps

    def _window(self, index: int) -> tuple[int, int]:
        """(file, token offset) of window `index`."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        file = bisect.bisect_right(self.starts, index) - 1
        return file, (index - self.starts[file]) * self.seq_len

    def __getitem__(self, index: int):
        inputs, targets = self.__getitems__([index])
        if isinstance(inputs, dict):
            return {k: v[0] for k, v in inputs.items()}, targets[0]
        return inputs[0], targets[0]

    def __getitems__(self, indices: list[int]):
        """The batch of windows `indices`: (inputs, targets), (B, seq_len) int64 each."""
        maps, length = self._mapped(), self.seq_len + 1
        rows = np.empty((len(indices), length), dtype=np.int64)
        for row, index in enumerate(indices):
            file, offset = self._window(index)
            rows[row] = maps[file][offset : offset + length]
        if self.vocab_size is not None and rows.size and rows.max() >= self.vocab_size:
            self._refuse(rows, indices)
        batch = torch.from_numpy(rows)
        inputs, targets = batch[:, :-1], batch[:, 1:].clone()
        if self.eos is None:
            return inputs, targets
        ends = inputs == self.eos
        targets[ends] = -100  # the token after a document's end starts the next: not this one's to predict
        return {"input_ids": inputs, "position_ids": position_ids(ends)}, targets

    def _refuse(self, rows: np.ndarray, indices: list[int]):
        row, column = np.argwhere(rows >= self.vocab_size)[0]
        file, offset = self._window(indices[row])
        raise DataError(
            f"token shard {str(self.files[file])!r} holds token id {rows[row, column]} at token offset"
            f" {offset + column}, at or above the model's vocabulary of {self.vocab_size}; it was written with"
            " another tokenizer or is corrupt"
        )


def position_ids(ends: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document: 0 at a row's start and after each end-of-document token."""
    length = ends.shape[-1]
    index = torch.arange(length).expand_as(ends)
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    starts[:, 0] = True
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first
