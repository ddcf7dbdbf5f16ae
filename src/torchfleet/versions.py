"""The torch releases torchfleet supports, and where the installed one stands.

The floor is the oldest torch CI runs the tests of torch's APIs on (`make test-floor`);
pyproject.toml's ``torch>=`` and the Makefile's TORCH_FLOOR say the same, and
a test keeps the three equal. 2.11 is the floor because it is the torch of
the GPU machine the project is checked on, and every strategy's API is there
(FSDP2's public ``fully_shard``, ``torch.distributed.pipelining``, DCP's
state-dict helpers). The newest tested is the newest CI has run.
"""

from __future__ import annotations

import re

import torch

from torchfleet.errors import UsageError

TORCH_FLOOR = (2, 11)
TORCH_NEWEST_TESTED = (2, 15)


def release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.14.1+cu130" or "2.16.0.dev20261101"."""
    found = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def _text(pair: tuple[int, int]) -> str:
    return f"{pair[0]}.{pair[1]}"


def tested_range() -> str:
    return f"{_text(TORCH_FLOOR)} to {_text(TORCH_NEWEST_TESTED)}"


def standing(version: str | None = None) -> tuple[str, str]:
    """("supported" | "too old" | "newer than tested", a sentence for doctor)."""
    version = version or torch.__version__
    got = release(version)
    if got < TORCH_FLOOR:
        return "too old", (
            f"torch {version} is older than {_text(TORCH_FLOOR)}, the oldest torchfleet"
            f" supports; pip install 'torch>={_text(TORCH_FLOOR)}'"
        )
    if got > TORCH_NEWEST_TESTED:
        return "newer than tested", (
            f"torch {version} is newer than {_text(TORCH_NEWEST_TESTED)}, the newest tested; expected to work"
        )
    return "supported", f"inside the tested range {tested_range()}"


def require_supported_torch() -> None:
    """One sentence, before any work, where the installed torch is below the floor."""
    verdict, sentence = standing()
    if verdict == "too old":
        raise UsageError(sentence)
