"""`--data text`: a byte-level corpus that needs no download, for `--model gpt`.

The text is the data-set descriptions scikit-learn ships (the .rst files in
sklearn/datasets/descr, about 43 KB of English prose and tables), joined in
file-name order, so it is the same bytes on every rank and every machine with
the same scikit-learn. Tokens are bytes (a vocabulary of 256): no tokenizer to
download or train. The last `val_fraction` of the bytes is the validation
split, so the two never share a byte.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.data import Dataset

from torchfleet.errors import UsageError
from torchfleet.train.bundled import sklearn_path

VOCAB_SIZE = 256  # bytes
SOURCE = ("datasets", "descr")  # inside scikit-learn: sklearn.datasets.descr


@functools.lru_cache(maxsize=1)
def corpus() -> bytes:
    """The corpus' bytes: every .rst file of SOURCE, in sorted order, each followed by a blank line."""
    files = sorted((f for f in sklearn_path(*SOURCE).iterdir() if f.name.endswith(".rst")), key=lambda f: f.name)
    return b"".join(f.read_bytes().rstrip(b"\n") + b"\n\n" for f in files)


class TokenBlocks(Dataset):
    """Consecutive, non-overlapping blocks of `block_size` tokens: item i is (input, target),
    both LongTensors of length `block_size`, the target the input shifted by one token."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        if block_size < 1:
            raise UsageError(f"block size {block_size} must be at least 1")
        if len(tokens) < block_size + 1:
            raise UsageError(
                f"{len(tokens)} tokens do not make one block of {block_size} and its next token;"
                " choose a smaller block size"
            )
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size  # each block also needs the token after it

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def text(split: str = "train", block_size: int = 64, val_fraction: float = 0.1) -> TokenBlocks:
    """The corpus' train or validation blocks (see the module doc)."""
    if split not in ("train", "val"):
        raise UsageError(f"unknown split {split!r}; choose train or val")
    tokens = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return TokenBlocks(tokens[:cut] if split == "train" else tokens[cut:], block_size)
