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

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("torchfleet")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

from torchfleet.errors import UsageError  # noqa: E402

__all__ = ["Fleet", "UsageError", "launch", "notebook_launch", "__version__"]

# Fleet and launch import torch, which takes seconds; loading them on first
# use keeps `torchfleet --help` and `torchfleet doctor --json` quick.
_LAZY = {"Fleet": "torchfleet.fleet", "launch": "torchfleet.launcher",
         "notebook_launch": "torchfleet.notebook"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchfleet' has no attribute {name!r}")
