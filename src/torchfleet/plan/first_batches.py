"""The batches a profile times first: far enough apart to tell a step's per-sample cost from its fixed one.

A slow model (a step of 2 samples over half a second) is timed at 1 and 2 samples, or at 2 and 4 where
one sample cannot train: BatchNorm refuses a single sample once a feature map has come down to 1 x 1
(resnet18 and resnet50 at 32 px; a loaded machine once timed resnet18 slow enough to be given batch 1, and
its plan failed there). A faster one is timed at 2, and at as many samples as fill about 0.3 s.
"""

from __future__ import annotations

import time

from torchfleet.plan.threads import torch_threads
from torchfleet.plan.workload import make_optimizer, train_step, workload


def first_batches(spec: dict, optimizer: str, cores: int, timed: bool = True) -> tuple[int, ...]:
    """The batch sizes to time `spec`'s model at (profiler.measure's default); `timed=False`: the small pair."""
    if not timed:
        return _small_pair(spec, optimizer)
    with torch_threads(cores):
        model, inputs, targets, loss_fn = workload(spec, 2)
        opt = make_optimizer(optimizer, model.parameters())
        train_step(model, opt, inputs, targets, loss_fn)
        # the fastest of three: load from elsewhere only ever adds, and one slow step would pick batches too small
        two = min(_seconds(lambda: train_step(model, opt, inputs, targets, loss_fn)) for _ in range(3))
    if two > 0.5:
        return _small_pair(spec, optimizer)
    # a small model: enough samples that the per-sample part is seen above the fixed one
    top = int(min(256, max(4, 2 * 0.3 / max(two, 1e-4))))
    return 2, max(3, top // 2), top


def _small_pair(spec: dict, optimizer: str) -> tuple[int, int]:
    return (1, 2) if _trains_on_one_sample(spec, optimizer) else (2, 4)


def _trains_on_one_sample(spec: dict, optimizer: str) -> bool:
    """Whether a training step at batch 1 runs, tried on fake tensors (no compute, no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            model, inputs, targets, loss_fn = workload(spec, 1)
            train_step(model, make_optimizer(optimizer, model.parameters()), inputs, targets, loss_fn)
    except ValueError:  # BatchNorm's "Expected more than 1 value per channel when training"
        return False
    except Exception:  # noqa: BLE001 (a fake kernel refuses: the profile measures such a model on real tensors)
        return True
    return True


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
