"""Checkpoints: verified, atomic directories (verified.py), sharded ones through DCP (sharded.py),
a directory of them, one per step (directory.py), and a peft model's adapters alone (adapters.py).

A checkpoint written by one strategy and number of processes loads into
another where the shapes allow: the format is the same for every strategy.
"""

from torchfleet.checkpoint import adapters
from torchfleet.checkpoint.directory import list_checkpoints, newest_good, prune, step_path
from torchfleet.checkpoint.verified import FORMAT, KILL_IN_SAVE, MANIFEST, atomic_write, load, save, sha256, verify

__all__ = [
    "FORMAT",
    "KILL_IN_SAVE",
    "MANIFEST",
    "adapters",
    "atomic_write",
    "list_checkpoints",
    "load",
    "newest_good",
    "prune",
    "save",
    "sha256",
    "step_path",
    "verify",
]
