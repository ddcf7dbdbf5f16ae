"""Streams and token shards in fleet.dataloader, in this process: every rank and worker its own share, none read
twice or skipped, the global batch kept, the position resumed on any number of processes; bad data in one sentence.

Ranks are played here by building each rank's loader with its (rank, world): the sharding is arithmetic on the
stream's order, the same in one process as in many. tests/data/test_stream_runs.py runs the real processes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

import token_data
from helpers import require_module
from torchfleet.data import DataError
from torchfleet.data.stream import stream_loader
from torchfleet.data.text_records import Document, TextRecords, Tokenize
from torchfleet.data.token_shards import TokenShards
from torchfleet.errors import UsageError
from torchfleet.fleet import Fleet


class Counting(IterableDataset):
    """0, 1, ..., n-1: a stream with no state of its own, so a resume reads past what was consumed."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _loader(dataset, batch, rank=0, world=1, workers=0, **kw):
    return stream_loader(dataset, batch, rank, world, 1, False, workers, 0, **kw)


def _global_batches(dataset, batch, world, workers=0, state=None) -> list[list]:
    """Each step's global batch as the ranks' shares put together, in rank order."""
    per_rank = []
    for rank in range(world):
        loader = _loader(dataset, batch, rank, world, workers)
        if state is not None:
            loader.load_state_dict(state)
        per_rank.append([_values(b) for b in loader])
    assert len({len(steps) for steps in per_rank}) == 1  # every rank runs the same number of steps
    return [sum((steps[k] for steps in per_rank), []) for k in range(len(per_rank[0]))]


def _values(batch) -> list:
    if isinstance(batch, dict):  # a Hugging Face record per sample, collated column by column
        columns = [batch[k] if isinstance(batch[k], list) else batch[k].tolist() for k in sorted(batch)]
        return list(zip(*columns, strict=True))
    return batch.tolist()


@pytest.mark.parametrize("world,workers", [(2, 2), (4, 0)])
def test_each_rank_and_worker_reads_its_share_and_the_global_batch_is_serials(world, workers):
    serial = _global_batches(Counting(103), 12, 1)
    assert serial == [list(range(k * 12, k * 12 + 12)) for k in range(8)]  # the incomplete 9th is dropped
    assert _global_batches(Counting(103), 12, world, workers) == serial


def test_a_stream_position_resumes_on_another_number_of_processes_and_workers():
    loader = _loader(Counting(103), 12, 0, 2, workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state == {"epoch": 0, "samples": 36, "stream": None}
    straight = _global_batches(Counting(103), 12, 1)
    assert _global_batches(Counting(103), 12, 1, workers=1, state=state) == straight[3:]
    assert _global_batches(Counting(103), 12, 3, state=state) == straight[3:]
    # A batch taken for example inputs leaves the next pass whole, and a finished pass starts the next epoch.
    again = _loader(Counting(30), 10)
    next(iter(again))
    assert [b.tolist()[0] for b in again] == [0, 10, 20] and again.epoch == 1


def test_a_stream_ending_before_the_first_global_batch_is_one_sentence():
    with pytest.raises(UsageError, match=r"the stream ended after 7 samples, before its first global batch of 8"):
        list(_loader(Counting(7), 8, workers=1))


@pytest.mark.parametrize("kind", ["json", "parquet", "text"])
def test_hugging_face_streams_from_local_files_share_and_resume_with_their_own_state(kind, tmp_path):
    datasets = require_module("datasets", "the data extra (pip install 'torchfleet[data]')")
    texts = token_data.sentences(60)
    if kind == "json":
        files = [str(token_data.jsonl(tmp_path / f"{i}.jsonl", texts[i * 30 : i * 30 + 30])) for i in range(2)]
    elif kind == "parquet":
        files = [str(token_data.parquet(tmp_path / "a.parquet", texts, row_group=7))]
    else:
        (tmp_path / "a.txt").write_text("\n".join(texts) + "\n")
        files = [str(tmp_path / "a.txt")]

    def stream():
        return datasets.load_dataset(kind, data_files=files, split="train", streaming=True).select_columns(["text"])

    serial = _global_batches(stream(), 8, 1)
    assert [t for step in serial for (t,) in step] == texts[:56]  # the files' order, the last 4 dropped
    assert _global_batches(stream(), 8, 2, workers=2) == serial
    loader = _loader(stream(), 8, 1, 2, workers=1)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = loader.state_dict()
    assert state["samples"] == 16 and state["stream"] is not None  # Hugging Face's own state, after sample 16
    assert _global_batches(stream(), 8, 1, state=state) == serial[2:]


def test_token_shards_are_memory_mapped_windows_and_refuse_bad_files_in_one_sentence(tmp_path):
    directory = token_data.shards(tmp_path / "shards", files=2, tokens=1000)
    tokens = np.fromfile(directory / "train01.bin", dtype=np.uint16)
    shards = TokenShards(directory, 64, vocab_size=256, split="train")
    assert len(shards) == 2 * (999 // 64)
    inputs, targets = shards[len(shards) - 1]  # the last window of the second file
    start = (999 // 64 - 1) * 64
    assert torch.equal(inputs, torch.from_numpy(tokens[start : start + 64].astype(np.int64)))
    assert torch.equal(targets, torch.from_numpy(tokens[start + 1 : start + 65].astype(np.int64)))
    assert len(TokenShards(directory, 64, split="val")) == 1199 // 64
    np.save(directory / "train02.npy", np.arange(200, dtype=np.uint32) + 250)  # ids 256 and up from offset 6
    bad = TokenShards(directory, 64, vocab_size=256, split="train")
    with pytest.raises(DataError, match=r"train02.npy' holds token id 256 at token offset 6, at or above the model"):
        bad.__getitems__([0, len(bad) - 3])
    (directory / "train03.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"train03.bin' has 3 bytes, not a whole number of uint16 tokens"):
        TokenShards(directory, 64)
    (directory / "train03.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"train03.bin' is empty"):
        TokenShards(directory, 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"holds no token files; put .bin \(nanoGPT\) or .npy"):
        TokenShards(tmp_path / "empty", 64)


def test_packed_documents_restart_their_positions_and_predict_nothing_across_an_end(tmp_path):
    eos = 0
    (tmp_path / "docs.bin").write_bytes(np.array([5, 6, 7, eos, 8, 9, eos, 4, 3, 2], dtype=np.uint16).tobytes())
    (inputs, targets), *_ = [TokenShards(tmp_path, 9, eos=eos).__getitems__([0])]
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 0, 8, 9, 0, 4, 3]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    assert targets.tolist() == [[6, 7, 0, -100, 9, 0, -100, 3, 2]]


def test_documents_are_tokenized_in_the_loaders_workers_and_resume_by_their_position(tmp_path):
    require_module("tokenizers", "the data extra (pip install 'torchfleet[data]')")
    texts = token_data.sentences(50)
    tokenizer = token_data.tokenizer(tmp_path / "tok", texts)
    token_data.jsonl(tmp_path / "docs" / "a.jsonl", texts[:20])
    token_data.parquet(tmp_path / "docs" / "b.parquet", texts[20:], row_group=8)
    records = TextRecords(tmp_path / "docs")
    assert len(records) == 50 and [r.text for r in records] == texts
    tokenize = Tokenize(tokenizer, 32)
    assert tokenize.vocab_size <= 200 and tokenize.eos is not None
    straight = [b[0] for b in _loader(TextRecords(tmp_path / "docs"), 8, workers=2, transform=tokenize)]
    assert len(straight) == 6
    inputs, targets = tokenize(Document("a.jsonl record 10", "text", text=texts[9]))
    assert torch.equal(straight[1][1], inputs)
    assert (targets == -100).any() and targets[0] == inputs[1]  # padded at the end, shifted by one
    loader = _loader(TextRecords(tmp_path / "docs"), 8, 0, 2, workers=1, transform=tokenize)
    it = iter(loader)
    for _ in range(3):  # into the parquet file: the state is (file 1, row 4)
        next(it)
    state = loader.state_dict()
    assert state["stream"] == {"file": 1, "offset": 0, "record": 4}
    resumed = _loader(TextRecords(tmp_path / "docs"), 8, workers=1, transform=tokenize)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b[0]) for a, b in zip(straight[3:], resumed, strict=True))
    (tmp_path / "bad.jsonl").write_text('{"text": "the ranks"}\n\n{"txt": "the ranks"}\n')
    with pytest.raises(DataError, match=r"^bad.jsonl record 2 is not a JSON object with a 'text' string; every"):
        list(_loader(TextRecords(tmp_path / "bad.jsonl"), 1, workers=1, transform=tokenize))
    with pytest.raises(
        DataError, match=r"document a.jsonl record 1 is \d+ tokens, longer than the model's 4 positions"
    ):
        list(_loader(TextRecords(tmp_path / "docs"), 8, workers=1, transform=Tokenize(tokenizer, 4)))


def test_a_stream_through_fleet_dataloader_refuses_replica_groups_and_uneven_batches():
    fleet = Fleet("serial")
    assert [b.tolist() for b in fleet.dataloader(Counting(10), 5)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(UsageError, match="does not split into 2 accumulation steps"):
        Fleet("serial", grad_accum=2).dataloader(Counting(10), 5)
    with pytest.raises(UsageError, match="a stream cannot be read under replica groups"):
        stream_loader(Counting(10), 4, 0, 1, 1, True, 0, 0)


def _train(argv: list[str], capsys) -> tuple[int, str]:
    from torchfleet import cli

    code = cli.main(["train", "--model", "gpt", "--strategy", "serial", "--no-progress", "--hang-timeout", "0", *argv])
    return code, capsys.readouterr().err


def test_train_data_paths_refuse_bad_input_in_one_sentence(tmp_path, capsys):
    require_module("tokenizers", "the data extra (pip install 'torchfleet[data]')")
    texts = token_data.sentences(20)
    tokenizer = str(token_data.tokenizer(tmp_path / "tok", texts))
    rng = np.random.default_rng(0)
    letters = [" ".join("".join(rng.choice(list("abcdefghijklmnop"), 4)) for _ in range(30)) for _ in range(300)]
    big = str(token_data.tokenizer(tmp_path / "big", letters, vocab=300))
    docs = str(token_data.jsonl(tmp_path / "docs.jsonl", texts))
    (tmp_path / "empty").mkdir()
    empty_shard = token_data.shards(tmp_path / "empty_shard", files=1, tokens=500)
    (empty_shard / "train01.bin").write_bytes(b"")
    wide = tmp_path / "wide"
    wide.mkdir()
    np.arange(500, dtype=np.uint16).tofile(wide / "train.bin")  # ids 256 and up from offset 256
    rows = [
        (["--data", str(tmp_path / "empty")], f"--data directory '{tmp_path / 'empty'}' is empty"),
        (["--data", str(empty_shard)], f"token shard '{empty_shard / 'train01.bin'}' is empty"),
        (["--data", docs], f"--data '{docs}' holds documents, which need --tokenizer DIR"),
        (["--data", docs, "--tokenizer", big], "has 300 tokens, more than the model's vocabulary of 256"),
        (["--data", docs, "--tokenizer", tokenizer, "--batch-size", "32"], "the stream holds 20 samples, fewer than"),
        (["--data", str(wide), "--batch-size", "6"], "holds token id 256 at token offset 256, at or above the model's"),
    ]
    for argv, sentence in rows:
        code, err = _train(argv, capsys)
        assert code == 2 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and sentence in err, err


def test_a_corrupt_shard_found_mid_run_stops_it_naming_file_offset_and_the_checkpoint_to_resume(tmp_path, capsys):
    from torchfleet.data import GlobalBatchSampler

    shards = token_data.shards(tmp_path / "shards", files=1, tokens=64 * 40 + 1)
    window = list(GlobalBatchSampler(40, 8, seed=0))[2][5]  # read at step 3, after step 2's checkpoint
    tokens = np.fromfile(shards / "train00.bin", dtype=np.uint16)
    tokens[window * 64 + 7] = 60000  # past gpt tiny's 256: a shard written by another tokenizer, or damaged
    tokens.tofile(shards / "train00.bin")
    ck = tmp_path / "ck"
    argv = ["--data", str(shards), "--batch-size", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    code, err = _train(argv, capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    named = f"token shard '{shards / 'train00.bin'}' holds token id 60000 at token offset {window * 64 + 7}"
    assert named in err and f"(read for step 3; --resume goes on from {ck / 'step-00000002'})" in err, err
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002"]  # nothing written after the bad read


def test_token_shards_follow_the_global_batch_and_its_position_on_any_number_of_ranks(tmp_path):
    from torchfleet.data import GlobalBatchSampler

    shards = TokenShards(token_data.shards(tmp_path / "shards", files=2, tokens=2000), 32, 256, split="train")

    def steps(world: int, state: dict | None = None) -> list[torch.Tensor]:
        """Each step's global batch of inputs: the ranks' shares put together in rank order."""
        per_rank = []
        for rank in range(world):
            sampler = GlobalBatchSampler(len(shards), 12, rank, world, seed=3)
            if state is not None:
                sampler.load_state_dict(state)
            per_rank.append([shards.__getitems__(indices)[0] for indices in sampler])
        return [torch.cat(share) for share in zip(*per_rank, strict=True)]

    serial = steps(1)
    assert len(serial) == len(shards) // 12 and all(torch.equal(a, b) for a, b in zip(serial, steps(3), strict=True))
    resumed = steps(2, {"epoch": 0, "position": 4, "seed": 3})  # a checkpoint after step 4, on 2 ranks
    assert all(torch.equal(a, b) for a, b in zip(serial[4:], resumed, strict=True))
