"""Small token data made on the spot for the data tests: shards, documents, a tokenizer trained here.

Nothing downloads: the documents are sentences drawn from a fixed word list
by a seeded generator, and the tokenizer is a byte-pair model trained on them
with the `tokenizers` library, small enough for gpt tiny's 256 tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

WORDS = (
    "the a ranks read their share of every global batch stream shard token window worker loader"
    " checkpoint resume step process model sequence document packs position order seed epoch"
).split()


def shards(directory: Path, files: int = 2, tokens: int = 6000, vocab: int = 256, seed: int = 0) -> Path:
    """`files` nanoGPT-style .bin files of uint16 tokens below `vocab`, and a val.npy."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(files):
        rng.integers(0, vocab, tokens, dtype=np.uint16).tofile(directory / f"train{i:02d}.bin")
    np.save(directory / "val.npy", rng.integers(0, vocab, 1200, dtype=np.uint16))
    return directory


def sentences(count: int, seed: int = 0, longest: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, longest))) for _ in range(count)]


def jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def parquet(path: Path, texts: list[str], row_group: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path, row_group_size=row_group)
    return path


def tokenizer(directory: Path, texts: list[str], vocab: int = 200) -> Path:
    """A byte-pair tokenizer of at most `vocab` tokens trained on `texts`, saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<unk>", "</s>"])
    tok.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory
