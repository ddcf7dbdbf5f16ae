"""Keep glibc's malloc from handing a training step's memory back to the kernel.

A CPU training step allocates the same activations and gradients every step
and frees them at its end. glibc returns large freed blocks to the kernel
(``munmap``, and trimming the top of the heap past 128 KiB), so the next step
faults every page in again, and pays for it in time (docs/benchmarks/history.md,
"Where 2-process scaling goes on this machine"). The faults also make step times uneven,
which costs twice in data-parallel training, where every step waits for the
slowest rank.

Raising ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` together (setting one
alone turns off glibc's adaptive thresholds and makes it worse) keeps freed
memory in the process for the next step, as PyTorch's CUDA caching
allocator does on GPUs. The price: a process keeps its peak heap resident
until it exits. ``TORCHFLEET_MALLOC=default`` leaves glibc's settings alone
(``keep``, the default, raises them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from torchfleet.errors import UsageError

VARIABLE = "TORCHFLEET_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
_KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap, and up to 1 GiB of free top is kept
_applied = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True when they are raised.

    A no-op (False) on other C libraries, or when TORCHFLEET_MALLOC=default.
    """
    global _applied
    choice = os.environ.get(VARIABLE, "keep") or "keep"
    if choice not in ("keep", "default"):
        raise UsageError(f"{VARIABLE}={choice!r} is not a choice; use keep (the default) or default")
    if _applied:
        return True
    if choice == "default" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success. glibc accepts both values on 64-bit Linux;
    # were the second refused, the first alone would leave it worse than before.
    _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
    return _applied
