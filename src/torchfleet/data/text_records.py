"""Documents from JSONL or parquet files, streamed in order and tokenized on the way.

`TextRecords` is a stream (an IterableDataset) of the documents in the
files' `field` ("text" by default): each JSONL line's object, or each parquet
row. It keeps its own position (file, byte offset or row), so a resume seeks
to it instead of reading the files again (data/stream.py loads it).

`Tokenize` is the per-sample transform `fleet.dataloader` runs in the loader
worker that keeps a document: a local tokenizer directory (tokenizers'
``tokenizer.json``, or anything transformers' AutoTokenizer reads from files;
nothing downloads), the document's tokens and an end-of-document token, one
sample of `seq_len` + 1 tokens padded at the end, whose padded targets are
-100 so that the loss skips them. A document is one sample, so the global
order of samples is the files' order, whatever the number of processes and
workers; a document longer than the model's positions is refused, naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from torchfleet.data import DataError
from torchfleet.errors import UsageError

SUFFIXES = (".jsonl", ".json", ".parquet")
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")  # the first the tokenizer has ends each document
PAD_NAMES = ("<pad>", "[PAD]", "<|padding|>")


def text_files(path: str | os.PathLike) -> list[Path]:
    """`path` if it is a JSONL or parquet file, else its directory's such files in name order."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"documents {str(path)!r} do not exist; give a .jsonl or .parquet file or a directory of them")
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
    if not files or any(f.suffix not in SUFFIXES for f in files):
        raise UsageError(
            f"{str(path)!r} holds no .jsonl or .parquet documents; give such a file or a directory of them"
        )
    return files


class Document:
    """One record: its text, and where it is ("a.jsonl record 17") for a sentence about it. A JSONL line is
    parsed only when its text is asked for, so the readers that skip a record (every loader worker but the one
    that keeps it, data/stream.py) pay for finding the line's end and nothing more."""

    __slots__ = ("_line", "_text", "field", "at")

    def __init__(self, at: str, field: str, text: str | None = None, line: bytes = b""):
        self.at, self.field, self._text, self._line = at, field, text, line

    @property
    def text(self) -> str:
        if self._text is None:
            try:
                value = json.loads(self._line)[self.field]
            except (ValueError, KeyError, TypeError):
                value = None
            if not isinstance(value, str):
                raise DataError(
                    f"{self.at} is not a JSON object with a {self.field!r} string; every line of a JSONL"
                    " document file must be one"
                )
            self._text = value
        return self._text


class TextRecords(IterableDataset):
    """The documents of JSONL or parquet files in order, as `Document`s (module doc)."""

    def __init__(self, path: str | os.PathLike, field: str = "text"):
        self.files, self.field = text_files(path), field
        self._position = {"file": 0, "offset": 0, "record": 0}  # where the next pass starts
        self._state = dict(self._position)  # just after the newest record yielded
        self._length: int | None = None

    def __len__(self) -> int:
        """Documents in all the files: JSONL's lines that are not blank, parquet's rows (from its footer)."""
        if self._length is None:
            self._length = sum(_count(f) for f in self.files)
        return self._length

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self._position = dict(state)

    def __iter__(self) -> Iterator[Document]:
        start, self._position = self._position, {"file": 0, "offset": 0, "record": 0}
        self._state = dict(start)
        for index in range(start["file"], len(self.files)):
            file = self.files[index]
            first = start if index == start["file"] else {"offset": 0, "record": 0}
            read = _jsonl if file.suffix != ".parquet" else _parquet
            for document, offset, record in read(file, self.field, first["offset"], first["record"]):
                self._state = {"file": index, "offset": offset, "record": record}
                yield document
            self._state = {"file": index + 1, "offset": 0, "record": 0}


def _count(file: Path) -> int:
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    with open(file, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def _jsonl(file: Path, field: str, offset: int, record: int) -> Iterator[tuple[Document, int, int]]:
    """(document, byte offset after its line, its record number from 1) for each JSONL record after `offset`."""
    with open(file, "rb") as fh:
        fh.seek(offset)
        for line in fh:
            offset += len(line)
            if line.strip():  # blank lines are no record
                record += 1
                yield Document(f"{file.name} record {record}", field, line=line), offset, record


def _parquet(file: Path, field: str, offset: int, record: int) -> Iterator[tuple[Document, int, int]]:
    """(document, 0, its row number from 1) for each parquet row after row `record` (whole row groups skipped)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file)
    if field not in parquet.schema_arrow.names:
        raise DataError(f"{file.name} has no column {field!r}; its columns are {', '.join(parquet.schema_arrow.names)}")
    row, groups = 0, []
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if row + rows > record:
            groups.append(group)
        else:
            row += rows
    for batch in parquet.iter_batches(columns=[field], row_groups=groups):
        for text in batch.column(0).to_pylist():
            row += 1
            if row <= record:
                continue
            if not isinstance(text, str):
                raise DataError(f"{file.name} row {row} holds {text!r} in column {field!r}, not a document's text")
            yield Document(f"{file.name} row {row}", field, text=text), 0, row


class Tokenize:
    """A document's tokens as one (input, target) sample of `seq_len` tokens each (module doc); picklable, the
    tokenizer loaded once in each process that uses it."""

    def __init__(self, directory: str | os.PathLike, seq_len: int):
        self.directory, self.seq_len = Path(directory), seq_len
        self._tokenizer = None
        info = self.load()  # here, so that a bad directory is said before any worker starts
        self.vocab_size, self.eos, self.pad = info.vocab_size, info.eos, info.pad

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None}

    def load(self) -> _Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = _Tokenizer(self.directory)
        return self._tokenizer

    def __call__(self, document: Document) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.load().encode(document.text)
        if self.eos is not None:
            ids.append(self.eos)
        length = self.seq_len + 1
        if len(ids) > length:
            raise DataError(
                f"document {document.at} is {len(ids)} tokens, longer than the model's {self.seq_len}"
                f" positions and the next token ({length}); split it, or write it as token shards"
                " (--data DIR of .bin or .npy files), whose windows take any document length"
            )
        tokens = torch.full((length,), self.pad, dtype=torch.long)
        tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        targets = tokens[1:].clone()
        targets[max(0, len(ids) - 1) :] = -100  # padding: nothing to predict
        return tokens[:-1], targets


class _Tokenizer:
    """A local tokenizer directory: tokenizers' tokenizer.json when it is there (no transformers import),
    else transformers' AutoTokenizer from the files alone."""

    def __init__(self, directory: Path):
        if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
            raise UsageError(
                f"--tokenizer {str(directory)!r} holds no tokenizer.json or tokenizer_config.json; give a"
                " directory a tokenizer was saved to (tokenizers' Tokenizer.save, or save_pretrained)"
            )
        if (directory / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(str(directory / "tokenizer.json"))
            self.encode = lambda text: fast.encode(text, add_special_tokens=False).ids
            vocab = fast.get_vocab(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            slow = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            self.encode = lambda text: slow.encode(text, add_special_tokens=False)
            vocab = slow.get_vocab()
        self.vocab_size = max(vocab.values()) + 1
        self.eos = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
        self.pad = next((vocab[n] for n in PAD_NAMES if n in vocab), self.eos or 0)
