"""`torchfleet.hogwild.run`: workers on one machine sharing one model's memory.

hogwild in one room, each module on the layer its job needs (tests/test_layers.py):
the runner that shares the model and spawns the workers (hogwild/runner.py, whose
`run` this is), the worker's side, the strategy `Fleet(strategy="hogwild")` runs
(hogwild/worker.py), and `torchfleet train --strategy hogwild` (hogwild/command.py).
"""

from torchfleet.hogwild.runner import run

__all__ = ["run"]
