"""`torchfleet.hogwild.run`: workers on one machine sharing one model's memory.

The public name of torchfleet/launcher/hogwild.py, where the runner lives; the
worker's side is the strategy in torchfleet/strategies/hogwild.py.
"""

from torchfleet.launcher.hogwild import run

__all__ = ["run"]
