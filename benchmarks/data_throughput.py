"""How fast torchfleet's data paths deliver batches (issue 58's figures, docs/benchmarks/index.md).

    python benchmarks/data_throughput.py [--only shards,tokenize,train] [--out FILE.json]

shards    memory-mapped token shards (64M uint16 tokens in 4 .bin files, written
          here) at sequence 1024, through fleet.dataloader in one process: tokens
          of batches delivered per second, one pass over 2,000 batches of 16.
tokenize  JSONL documents (20,000 of 40 to 160 words) tokenized on the way by a
          byte-pair tokenizer of 4,096 tokens trained here, with 0, 1 and 2
          loader workers: the documents' tokens per second (padding not counted).
train     `torchfleet train --model gpt` (tiny) on 2 processes (ddp) over token
          shards: each rank's data phase as a share of its step, from the
          per-rank rows of --metrics-out.

Everything is made in a temporary directory; nothing downloads.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(3000)] + "the of and a to in is was for on that with as by".split()


def shards(root: Path) -> dict:
    from torchfleet import Fleet
    from torchfleet.data.token_shards import TokenShards

    directory = root / "shards"
    directory.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        rng.integers(0, 50257, 16 * 2**20, dtype=np.uint16).tofile(directory / f"train{i}.bin")
    loader = Fleet("serial").dataloader(TokenShards(directory, 1024, vocab_size=50257), 16, seed=0)
    batches, tokens, start = 0, 0, time.perf_counter()
    for inputs, _ in loader:
        tokens += inputs.numel()
        batches += 1
        if batches == 2000:
            break
    seconds = time.perf_counter() - start
    return {"batches": batches, "seconds": seconds, "tokens_per_s": tokens / seconds}


def tokenize(root: Path) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from torchfleet import Fleet
    from torchfleet.data.text_records import TextRecords, Tokenize

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160))) for _ in range(20000)]
    (root / "docs").mkdir()
    (root / "docs" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts[:2000], trainers.BpeTrainer(vocab_size=4096, special_tokens=["<pad>", "</s>"]))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    figures = {}
    for workers in (0, 1, 2):
        loader = Fleet("serial").dataloader(
            TextRecords(root / "docs"), 32, num_workers=workers, transform=Tokenize(root / "tok", 1024)
        )
        tokens, start = 0, time.perf_counter()
        for _, targets in loader:
            tokens += int((targets != -100).sum()) + targets.shape[0]  # each document's tokens, its first too
        seconds = time.perf_counter() - start
        figures[f"{workers}_workers_tokens_per_s"] = tokens / seconds
    return figures


def train(root: Path) -> dict:
    directory = root / "small"
    directory.mkdir()
    rng = np.random.default_rng(1)
    for i in range(2):
        rng.integers(0, 256, 2**20, dtype=np.uint16).tofile(directory / f"train{i}.bin")
    metrics = root / "metrics.jsonl"
    command = [sys.executable, "-m", "torchfleet", "train", "--model", "gpt", "--data", str(directory)]
    command += ["--strategy", "ddp", "-n", "2", "--max-steps", "200", "--log-every", "20", "--no-progress"]
    subprocess.run([*command, "--metrics-out", str(metrics)], check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    ranks = [r for r in rows if r.get("kind") == "rank" and r["step"] > 20]  # the first window holds warm-up
    data, step = sum(r["data_s"] for r in ranks), sum(r["step_s"] for r in ranks)
    return {
        "windows": len(ranks),
        "data_ms_per_step": 1e3 * data / len(ranks),
        "step_ms": 1e3 * step / len(ranks),
        "data_share": data / step,
        "worst_window_share": max(r["data_s"] / r["step_s"] for r in ranks),
    }


PARTS = {"shards": shards, "tokenize": tokenize, "train": train}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts (default: all)")
    parser.add_argument("--out", help="write the figures as JSON")
    args = parser.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            part = Path(tmp) / name
            part.mkdir()
            figures[name] = PARTS[name](part)
            print(name, json.dumps(figures[name], indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
