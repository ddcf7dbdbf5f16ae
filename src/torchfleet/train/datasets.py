"""Built-in data for `torchfleet train` and `torchfleet bench`.

`digits` is real data shipped inside scikit-learn (1,797 8x8 hand-written
digits), so the built-in job needs no download; `text` (text.py) is a
byte-level corpus from the same package, for `gpt`. `synthetic` is random
data of any shape, and `MockLoader` (images) and `MockTokens` (token
sequences) yield one batch held in memory forever, as the benchmark notebook
in the project's seeds does, so that loading is not timed.

`--data PATH` is the user's own tokens for gpt: a directory of token shards
(data/token_shards.py), or JSONL or parquet documents tokenized on the way
with `--tokenizer DIR` (data/text_records.py), read as a stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, TensorDataset

from torchfleet.errors import UsageError
from torchfleet.train.bundled import sklearn_path
from torchfleet.train.text import text

DATASETS = ("digits", "synthetic", "text")
TOKEN_DATASETS = ("text",)  # token sequences, for the token models (gpt); the others hold images
SHARDS, DOCUMENTS = "token shards", "documents"  # what a --data PATH holds (path_kind)


def digits(split: str = "train", val_fraction: float = 0.2, seed: int = 0) -> TensorDataset:
    """scikit-learn's digits as (N, 1, 8, 8) floats in [0, 1] and int64 labels.

    The train/validation split is a fixed permutation of `seed`, the same on
    every rank and every run.
    """
    if split not in ("train", "val"):
        raise UsageError(f"unknown split {split!r}; choose train or val")
    pixels, labels = digits_arrays()
    images = pixels.view(-1, 1, 8, 8) / 16.0
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * val_fraction)
    idx = order[:n_val] if split == "val" else order[n_val:]
    return TensorDataset(images[idx], labels[idx])


def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels as float32 of 0 to 16, labels as int64): the file `sklearn.datasets.load_digits` reads, one
    row per image (its 8x8 pixels row by row, then the label), read without importing scikit-learn."""
    import numpy as np

    rows = np.loadtxt(sklearn_path("datasets", "data", "digits.csv.gz"), delimiter=",")
    return torch.tensor(rows[:, :-1], dtype=torch.float32), torch.tensor(rows[:, -1], dtype=torch.int64)


def synthetic(
    size: int, shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10, seed: int = 0, split: str = "train"
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

    def __init__(
        self, shape: tuple[int, ...], num_classes: int = 10, device: str | torch.device = "cpu", seed: int = 0
    ):
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.rand(shape, generator=gen).to(device)
        self.targets = torch.randint(0, num_classes, (shape[0],), generator=gen).to(device)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.inputs, self.targets


class MockTokens:
    """MockLoader for token models: one batch of random token sequences, yielded forever.

    The target is the input shifted by one token, as in the text corpus; the
    tokens are random, so the figures measure speed, not learning.
    """

    def __init__(self, batch: int, block_size: int, vocab_size: int, device: str | torch.device = "cpu", seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (batch, block_size + 1), generator=gen).to(device)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.inputs, self.targets


def builtin_dataset(
    name: str,
    split: str,
    seed: int = 0,
    size: int = 4096,
    shape: tuple[int, ...] = (1, 8, 8),
    num_classes: int = 10,
    block_size: int = 64,
) -> Dataset:
    """The dataset `torchfleet train --data NAME` uses (`block_size`: text's sequence length)."""
    if name == "text":
        return text(split, block_size)
    if name == "digits":
        return digits(split, seed=seed)
    if name == "synthetic":
        n = size if split == "train" else max(1, size // 5)
        return synthetic(n, shape, num_classes, seed=seed, split=split)
    raise UsageError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")


def path_kind(path: str) -> str:
    """SHARDS or DOCUMENTS: what `--data PATH` holds, from its files' suffixes (the contents are read later)."""
    from pathlib import Path

    from torchfleet.data import text_records, token_shards

    place = Path(path)
    if not place.exists():
        raise UsageError(
            f"unknown data set {path!r}: neither a built-in one ({', '.join(DATASETS)}) nor a path that exists;"
            " give one of those, a directory of token shards (.bin, .npy) or JSONL or parquet documents"
        )
    names = [place] if place.is_file() else list(place.iterdir())
    if any(p.suffix in token_shards.SUFFIXES for p in names):
        return SHARDS
    if any(p.suffix in text_records.SUFFIXES for p in names):
        return DOCUMENTS
    if place.is_dir() and not names:
        raise UsageError(f"--data directory {path!r} is empty; put token shards (.bin, .npy) or documents in it")
    raise UsageError(f"--data {path!r} holds neither token shards (.bin, .npy) nor documents (.jsonl, .parquet)")


def path_datasets(path: str, tokenizer: str | None, seq_len: int, vocab_size: int):
    """(train set, validation set or None, the per-sample transform or None) for `--data PATH`.

    Token shards: the files whose names start with "val" are the validation set, the others the training
    set. Documents: a stream, tokenized by `Tokenize` in the loader's worker; no validation set."""
    from torchfleet.data.text_records import TextRecords, Tokenize
    from torchfleet.data.token_shards import TokenShards, token_files

    if path_kind(path) == SHARDS:
        if not token_files(path, "train"):
            raise UsageError(f"--data {path!r} holds only validation shards (val*); add training shards beside them")
        val = TokenShards(path, seq_len, vocab_size, split="val") if token_files(path, "val") else None
        return TokenShards(path, seq_len, vocab_size, split="train"), val, None
    assert tokenizer is not None  # TrainConfig asks for --tokenizer with documents
    tokenize = Tokenize(tokenizer, seq_len)
    if tokenize.vocab_size > vocab_size:
        raise UsageError(
            f"--tokenizer {tokenizer!r} has {tokenize.vocab_size} tokens, more than the model's vocabulary of"
            f" {vocab_size}; use a tokenizer of at most {vocab_size} tokens or a --gpt-preset with a larger one"
        )
    return TextRecords(path), None, tokenize
