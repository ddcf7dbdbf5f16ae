"""`torchfleet.hogwild.run`: workers on one machine sharing one model's memory.

hogwild in one room, each module on the layer its job needs (tests/test_layers.py):
the runner that shares the model and spawns the workers (hogwild/runner.py, whose
`run` this is), and the worker's side, the strategy `Fleet(strategy="hogwild")` runs
(hogwild/worker.py). `torchfleet train --strategy hogwild` is the built-in job's, and
lives with it (train/hogwild.py): hogwild imports nothing of train.
"""

from torchfleet.hogwild.runner import run

__all__ = ["run"]
