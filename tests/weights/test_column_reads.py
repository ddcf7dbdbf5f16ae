"""A column split's share read from a safetensors file: each row's run into its place, one preadv a block."""

from __future__ import annotations

import os

import pytest
import torch

from torchfleet.errors import UsageError
from torchfleet.weights import files
from torchfleet.weights.files import SINGLE, FileWriter, WeightFiles

TENSORS = {
    "w": torch.arange(37 * 12, dtype=torch.float32).view(37, 12),  # a Linear's weight: rows of 12 columns
    "experts": torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)),  # split on its second dimension
    "half": torch.randn(9, 10).to(torch.bfloat16),
}


@pytest.fixture
def weights(tmp_path) -> WeightFiles:
    writer = FileWriter(tmp_path / SINGLE, [(k, t.dtype, tuple(t.shape)) for k, t in TENSORS.items()])
    for t in TENSORS.values():
        writer.add(t)
    writer.close()
    return WeightFiles(tmp_path)


# (key, start, shape): a run at the start, in the middle and at the end of each row; a row range too.
REGIONS = [
    ("w", (0, 0), (37, 4)),
    ("w", (0, 4), (37, 4)),
    ("w", (0, 8), (37, 4)),
    ("w", (5, 3), (20, 9)),
    ("experts", (0, 2), (3, 2, 7)),
    ("experts", (1, 0), (2, 1, 7)),
    ("half", (2, 5), (7, 5)),
]


@pytest.mark.parametrize("key, start, shape", REGIONS)
def test_a_column_run_reads_the_same_values_as_slicing(weights, key, start, shape):
    out = torch.full(shape, -1.0, dtype=TENSORS[key].dtype)
    weights.read_into(key, start, out)
    want = TENSORS[key][tuple(slice(s, s + n) for s, n in zip(start, shape, strict=False))]
    assert torch.equal(out, want)
    # the file's rows it spans, read once each: the runs and the bytes around them
    row = TENSORS[key][0].numel() * TENSORS[key].element_size()
    assert weights.bytes_read == shape[0] * row


def test_short_reads_are_resumed_where_they_stopped(weights, monkeypatch):
    """A preadv that returns part of what was asked (a signal, a huge request) is called again from there."""
    real, calls = os.preadv, []

    def short(fd, buffers, offset):  # at most 10 bytes a call, cut inside a buffer as often as not
        calls.append(offset)
        first = memoryview(buffers[0])[:10]
        return real(fd, [first], offset)

    monkeypatch.setattr(files.os, "preadv", short)
    monkeypatch.setattr(files, "_IOV_MAX", 6)  # two rows a call: several calls, each cut short
    out = torch.empty(37, 4)
    weights.read_into("w", (0, 4), out)
    assert torch.equal(out, TENSORS["w"][:, 4:8])
    assert len(calls) > 37


def test_a_truncated_file_is_one_sentence(tmp_path):
    writer = FileWriter(tmp_path / SINGLE, [("w", torch.float32, (37, 12))])
    writer.add(TENSORS["w"])
    writer.close()
    path = tmp_path / SINGLE
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(UsageError, match="truncated"):
        WeightFiles(tmp_path).read_into("w", (0, 4), torch.empty(37, 4))
    # Mapped as a column split (tp alone), the last rows' columns are within the file but the rows are not.
    with pytest.raises(UsageError, match="truncated"):
        WeightFiles(tmp_path).mapped("w", (0, 0), (37, 4), torch.float32, columns=True)


def test_a_column_split_is_mapped_as_a_view_of_its_rows(weights):
    view = weights.mapped("w", (3, 4), (5, 6), torch.float32, columns=True)
    assert view is not None and not view.is_contiguous()
    assert torch.equal(view, TENSORS["w"][3:8, 4:10]) and weights.bytes_mapped == 5 * 12 * 4
    assert weights.mapped("w", (3, 4), (5, 6), torch.float32) is None  # not a run of the file's bytes
