"""Torch's intra-op thread count, set for a measurement and given back after it, whatever happens.

The count is the process's: a planner run inside a user's script (or a test run) that left it changed would
change every later CPU result, not only speed. Reductions split their sums by thread, so a training step at
one thread and at two differ in the last bits; a run compared with serial's weights would then differ for a
reason that has nothing to do with its strategy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
