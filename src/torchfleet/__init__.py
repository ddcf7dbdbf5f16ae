"""torchfleet: one PyTorch training script, every way of running it in parallel.

    import torchfleet
    fleet = torchfleet.Fleet(strategy="ddp", precision="bf16")
    model, optimizer = fleet.setup(model, optimizer)
    loader = fleet.dataloader(dataset, batch_size=256, shuffle=True)  # global batch
    for inputs, targets in loader:
        loss = fleet.train_step(inputs, targets, loss_fn)

The same script runs with ``python script.py`` (one process),
``torchfleet run -n 2 script.py`` and ``torchrun --nproc-per-node 2 script.py``.
"""

from typing import TYPE_CHECKING

from torchfleet.errors import UsageError

if TYPE_CHECKING:  # what __getattr__ below loads, named for type checkers and editors
    from torchfleet.fleet import Fleet
    from torchfleet.launcher.agent import launch
    from torchfleet.launcher.notebook import notebook_launch

    __version__: str

__all__ = ["Fleet", "UsageError", "launch", "notebook_launch", "__version__"]

# Fleet and launch import torch, which takes seconds; loading them on first
# use keeps `torchfleet --help` and `torchfleet doctor --json` quick. The
# version too (installed.py says why).
_LAZY = {
    "Fleet": "torchfleet.fleet",
    "launch": "torchfleet.launcher.agent",
    "notebook_launch": "torchfleet.launcher.notebook",
}


def __getattr__(name: str):
    if name == "__version__":
        from torchfleet import installed

        return installed.version()
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchfleet' has no attribute {name!r}")
