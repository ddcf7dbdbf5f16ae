"""A Hugging Face directory of safetensors files, read a region at a time and written a tensor at a time.

The format (huggingface/safetensors): 8 bytes holding the header's length, the header (JSON: each
tensor's dtype, shape and byte offsets), then the tensors' bytes, row-major. A directory holds
``model.safetensors``, or ``model.safetensors.index.json`` whose ``weight_map`` names the file of each
key. A rank takes only the bytes of its slice. Where the slice is one run of bytes in the tensor's own
dtype on the CPU (an even row-split shard, a whole tensor), its storage is a private copy-on-write
mapping of the file, as safetensors' own reader gives it: nothing is read until a page is touched, and
the page cache's pages are used rather than copied into freshly faulted memory (whose faults cost more
than the copy). A write (an optimizer step) makes the process its own copy of a page; the file never
changes. A column-split slice that nothing wraps further (tp alone) is a strided view over the mapping of
its rows: a rank's pages then hold some of its neighbours' columns, which a first forward maps in too (the
page cache's, shared) and an optimizer step copies where a page holds some of its own (docs/benchmarks).
Other slices are read with `os.preadv`: the rows of a row-split tensor straight into its storage, and
each row's run of a column-split one into its place, one call a block of rows (the bytes around the runs
into a scratch buffer). ``TORCHFLEET_MAP_WEIGHTS=0`` reads every slice.

A mapped file must not be rewritten in place while the model lives (a shortened file faults the process,
a rewritten one changes its weights): `save_model` writes a new directory and renames it over the old one,
so the old files live on, unlinked, until the process ends.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from torchfleet.errors import UsageError

SINGLE = "model.safetensors"
ADAPTERS = "adapter_model.safetensors"  # peft's save_pretrained: one file, no index
INDEX = "model.safetensors.index.json"
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
BLOCK_BYTES = 32 << 20  # rows read at once where a slice is not contiguous in the file
_READ_MAX = 1 << 30  # bytes a preadv is asked for at once (Linux returns at most about 2 GiB a call)
MAP_VARIABLE = "TORCHFLEET_MAP_WEIGHTS"


def _iov_max() -> int:
    """How many buffers one `preadv` fills (1024 on Linux); 1024 where the system does not say."""
    try:
        return max(3, os.sysconf("SC_IOV_MAX"))
    except (AttributeError, ValueError, OSError):
        return 1024


_IOV_MAX = _iov_max()


def mapping_allowed() -> bool:
    """Whether a slice that is one run of the file's bytes may be mapped rather than read (0 opts out)."""
    return os.environ.get(MAP_VARIABLE, "1") != "0"


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes are, its dtype and shape."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset of its first byte in the file


def _header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"{path} is not a safetensors file ({type(exc).__name__}: its header cannot be read)"
        ) from None
    return header, 8 + length


class WeightFiles:
    """The tensors of a Hugging Face model directory: {key: Entry}, from the headers alone."""

    def __init__(self, directory: str | os.PathLike, what: str = "weights"):
        self.directory, self.what = Path(directory), what
        if not self.directory.is_dir():
            raise UsageError(f"{what} {str(directory)!r} is not a directory; give a Hugging Face model directory")
        files = self._files()
        self.entries: dict[str, Entry] = {}
        for file in files:
            header, start = _header(file)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info.get("dtype") not in DTYPES:
                    raise UsageError(
                        f"{file.name} holds {key} as {info.get('dtype')}, a dtype torchfleet does not read;"
                        f" it reads {', '.join(DTYPES)}"
                    )
                self.entries[key] = Entry(
                    file, DTYPES[info["dtype"]], tuple(info["shape"]), start + info["data_offsets"][0]
                )
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self.nbytes = sum(math.prod(e.shape) * e.dtype.itemsize for e in self.entries.values())
        self.bytes_read = 0  # what this process read of the files (a rank reads its share: tests hold it)
        self.bytes_mapped = 0  # what it mapped instead of reading

    def _files(self) -> list[Path]:
        if self.what == "adapters":
            if (self.directory / ADAPTERS).is_file():
                return [self.directory / ADAPTERS]
            raise UsageError(
                f"adapters {str(self.directory)!r} holds no {ADAPTERS}; give a directory that peft's save_pretrained"
                " wrote"
            )
        index = self.directory / INDEX
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise UsageError(f"{index} is not a safetensors index (it has no weight_map of key to file)") from None
            missing = [n for n in names if not (self.directory / n).is_file()]
            if missing:
                raise UsageError(
                    f"{index.name} in {self.directory} names {missing[0]}, which is not there"
                    f" ({len(missing)} of {len(names)} files missing); copy the whole directory"
                )
            return [self.directory / n for n in names]
        if (self.directory / SINGLE).is_file():
            return [self.directory / SINGLE]
        present = sorted(p.name for p in self.directory.iterdir())[:6]
        raise UsageError(
            f"{self.what} {str(self.directory)!r} holds neither {SINGLE} nor {INDEX}"
            f" (it holds {', '.join(present) or 'nothing'}); give a directory that save_pretrained wrote in safetensors"
        )

    def read_into(self, key: str, start: tuple[int, ...], out: torch.Tensor) -> None:
        """The region of tensor `key` that starts at `start` and has `out`'s shape, into `out` (cast to its dtype).

        Straight into `out` where the region is whole rows of the file's tensor and `out` is contiguous in the
        file's dtype (a row-split shard): no copy, and its pages touched once. A run of the second dimension
        (a column split) likewise, each row's run into its place (`_pread_columns`). Otherwise a block of whole rows at
        a time, at most BLOCK_BYTES, copied out of: the transient memory stays one block (a mapping of the file's
        block, unmapped once copied from, so no fresh memory is faulted in for it; read into memory if mapping
        is off)."""
        entry = self.entries[key]
        full, shape = entry.shape, tuple(out.shape)
        if out.numel() == 0:
            return
        size = entry.dtype.itemsize
        row = math.prod(full[1:]) * size if full else size  # bytes of one index of the first dimension
        whole_rows = not full or shape[1:] == tuple(full[1:])
        if whole_rows and out.dtype == entry.dtype and out.is_contiguous():
            self._pread(entry, entry.begin + (start[0] * row if full else 0), out)
            return
        if len(full) >= 2 and shape[2:] == tuple(full[2:]) and out.dtype == entry.dtype and out.is_contiguous():
            self._pread_columns(entry, start[:2], out)
            return
        per_block = max(1, BLOCK_BYTES // row)
        rest = tuple(slice(s, s + n) for s, n in zip(start[1:], shape[1:], strict=True))
        for first in range(0, shape[0] if full else 1, per_block):
            rows = min(per_block, shape[0] - first) if full else 1
            block = self._block(entry, entry.begin + ((start[0] + first) * row if full else 0), (rows, *full[1:]))
            if full:
                out[first : first + rows] = block[(slice(None), *rest)]
            else:
                out.copy_(block)

    def _pread_columns(self, entry: Entry, start: tuple[int, ...], out: torch.Tensor) -> None:
        """A run of the second dimension of tensor `entry` (a column split), every index of the later ones, into
        `out`: one `preadv` per block of rows, each row's run read into its place in `out` and the bytes around
        it into a scratch buffer. The file is read in order and in one copy, as the page cache holds it: neither
        a mapping of the rows (a fault each few pages) nor a strided copy out of it, which was slower in memory
        touched before (docs/benchmarks; a first load is bound by its new memory's page faults either way)."""
        size, full = entry.dtype.itemsize, entry.shape
        inner = math.prod(full[2:]) * size  # bytes of one index of the second dimension
        row, run = full[1] * inner, out.shape[1] * inner
        before, after = start[1] * inner, (full[1] - start[1] - out.shape[1]) * inner
        mine = memoryview(out.view(-1).view(torch.uint8).numpy().data)
        scratch = memoryview(bytearray(max(before, after)))
        per = max(1, min(_IOV_MAX // 3, _READ_MAX // row))  # rows a call: three buffers each, within one read
        for first in range(0, out.shape[0], per):
            rows = range(first, min(first + per, out.shape[0]))
            buffers = []
            for r in rows:
                buffers += [scratch[:before]] if before else []
                buffers.append(mine[r * run : (r + 1) * run])
                buffers += [scratch[:after]] if after else []
            self._preadv(entry, entry.begin + (start[0] + first) * row, buffers)

    def _preadv(self, entry: Entry, offset: int, buffers: list[memoryview]) -> None:
        """Fill `buffers` in order from the file's bytes at `offset`, however short a call returns."""
        fd, done, first = self._fd(entry.file), 0, 0
        while first < len(buffers):
            got = os.preadv(fd, buffers[first:] if first else buffers, offset + done)
            if got <= 0:
                raise UsageError(f"{entry.file} ends before its header says (truncated); copy it again")
            done += got
            while first < len(buffers) and got >= len(buffers[first]):
                got -= len(buffers[first])
                first += 1
            if got:
                buffers[first] = buffers[first][got:]
        self.bytes_read += done

    def mapped(
        self, key: str, start: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype, columns: bool = False
    ) -> torch.Tensor | None:
        """The region of tensor `key` at `start` of `shape`, as a tensor over a private copy-on-write mapping of its
        file; None where the region is not one run of the file's bytes in `dtype`, aligned to it, or is empty.
        With `columns`, also a run of the second dimension in each row (a column split): a strided view over
        the mapping of its rows.

        One mapping of each whole file, shared by the tensors taken from it: one descriptor per file stays open
        (Python's mmap keeps its own) however many tensors there are, and only touched pages are resident."""
        entry = self.entries[key]
        full = entry.shape
        if entry.dtype != dtype or not shape or math.prod(shape) == 0 or len(shape) != len(full):
            return None
        split = tuple(shape[1:]) != tuple(full[1:])
        if split and not (columns and tuple(shape[2:]) == tuple(full[2:])):
            return None
        row = math.prod(full[1:]) * dtype.itemsize
        offset = entry.begin + start[0] * row
        if offset % dtype.itemsize:
            return None
        table = self._maps.get(entry.file)
        if table is None:
            table = self._maps[entry.file] = mmap.mmap(
                self._fd(entry.file), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        span = shape[0] * row if split else math.prod(shape) * dtype.itemsize  # a column split maps its whole rows
        if offset + span > len(table):
            raise UsageError(f"{entry.file} ends before its header says (truncated); copy it again")
        self.bytes_mapped += span
        mapped = torch.frombuffer(table, dtype=dtype, count=span // dtype.itemsize, offset=offset)
        if not split:
            return mapped.view(shape)
        return mapped.view(shape[0], *full[1:])[:, start[1] : start[1] + shape[1]]

    def _block(self, entry: Entry, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The file's `shape` rows of `entry` at `offset`: over a mapping of their own, freed with the tensor."""
        shape = shape if entry.shape else ()
        count, size = math.prod(shape), entry.dtype.itemsize
        inner = offset % mmap.ALLOCATIONGRANULARITY
        if not mapping_allowed() or offset % size:
            block = torch.empty(shape, dtype=entry.dtype)
            self._pread(entry, offset, block)
            return block
        if offset + count * size > os.fstat(self._fd(entry.file)).st_size:
            raise UsageError(f"{entry.file} ends before its header says (truncated); copy it again")
        table = mmap.mmap(
            self._fd(entry.file),
            inner + count * size,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=offset - inner,
        )
        self.bytes_read += count * size
        return torch.frombuffer(table, dtype=entry.dtype, count=count, offset=inner).view(shape)

    def _fd(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def _pread(self, entry: Entry, offset: int, into: torch.Tensor) -> None:
        self._preadv(entry, offset, [memoryview(into.view(-1).view(torch.uint8).numpy().data)])

    def close(self) -> None:
        """The descriptors closed; the mappings stay, held by the tensors over them, until the last is freed."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._maps.clear()


class FileWriter:
    """A safetensors file of `entries` (key, dtype, shape), written one tensor at a time with `add`, in their
    order: the header is known before any tensor is, so none waits in memory for the others."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header: dict = {"__metadata__": {"format": "pt"}}  # transformers reads only files that say "pt"
        offset = 0
        for key, dtype, shape in entries:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.entries, self.nbytes, self.done = entries, offset, 0
        self.fh = open(path, "wb")
        self.fh.write(struct.pack("<Q", len(raw)))
        self.fh.write(raw)

    def add(self, tensor: torch.Tensor) -> None:
        key, dtype, shape = self.entries[self.done]
        assert tensor.dtype == dtype and tuple(tensor.shape) == tuple(shape), f"{key}: {tensor.dtype} {tensor.shape}"
        self.fh.write(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
        self.done += 1

    def close(self) -> None:
        assert self.done == len(self.entries), f"{self.fh.name}: {self.done} of {len(self.entries)} tensors written"
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
