"""The single-process reference the cluster tests compare with, trained once per session.

examples/train_digits.py run with `--strategy serial --epochs 1`: a run of the same global
batch on any number of processes must end with these weights (within 1e-5).
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import torch

from helpers import EXAMPLES, run

SCRIPT = str(EXAMPLES / "train_digits.py")
EPOCHS = "1"


def weights(path) -> torch.Tensor:
    return torch.cat([t.flatten() for t in torch.load(path, weights_only=True).values()])


@functools.lru_cache(maxsize=1)
def serial_weights() -> torch.Tensor:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serial.pt"
        result = run([sys.executable, SCRIPT, "--strategy", "serial", "--epochs", EPOCHS, "--out", str(out)])
        assert result.returncode == 0, result.stderr
        return weights(out)


def max_difference(path) -> float:
    return (weights(path) - serial_weights()).abs().max().item()


def close_to_serial(path, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """torch.allclose with the serial weights. Summing 4 ranks' gradients reassociates
    float additions, and Adam's normalisation carries the last bits into the weights,
    so runs on 4 processes are compared relative to each weight's size as well."""
    return torch.allclose(weights(path), serial_weights(), rtol=rtol, atol=atol)
