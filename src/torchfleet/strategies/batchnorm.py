"""BatchNorm under every strategy: which statistics each one normalises with, and synchronised ones.

A BatchNorm layer in training mode normalises with the mean and variance of
the batch it is given. `serial` gives it the whole global batch; a
data-parallel process gives it only its share, so ddp, fsdp and hsdp
normalise with each share's statistics and end away from serial's weights
(docs/concepts/equivalence.md, "BatchNorm"), and micro-batched
strategies (mp, pipeline) normalise each micro-batch. `batchnorm_note` says
which, once, when a model has BatchNorm.

`SyncBatchNorm` normalises with the statistics of the whole global batch:
each process sums x per channel (and counts) over its share, an all-reduce
across the data-parallel group gives the global mean, a second one the sum
of squared deviations from it (`_global_moments` says why two), and every
process normalises with the same mean and biased variance and updates its
running statistics with the same unbiased variance and momentum as
nn.BatchNorm. torch's own `nn.SyncBatchNorm` refuses CPU tensors (its
kernels are CUDA's); this one is written with ordinary tensor operations and
a differentiable all-reduce, so it runs on Gloo and CPU as on NCCL and CUDA,
at the cost of a few unfused element-wise kernels. Measured on 2 processes
(tests/strategies/test_batchnorm.py, a CNN with BatchNorm2d and BatchNorm1d, 5 steps):
ddp and fsdp end 2.1e-7 (SGD) and 3.7e-7 (AdamW) from serial's weights and
running statistics, against 4.0e-2 without synchronisation.

Why its gradient is serial's. Let W processes each hold a share of B/W
samples, and L_r be process r's loss, the mean over its share; serial's loss
is L = (1/W) sum_r L_r. With global statistics, L_r depends on every
process's activations through the all-reduced sums S. The all-reduce's
backward is an all-reduce of the gradients (SUM), so process r receives
dS = sum_r' dL_r'/dS and its backward accumulates into its parameters the
gradient of sum_r' L_r' along every path through its own share. Summed over
processes that is d(sum_r L_r)/d(theta) = W dL/d(theta); DDP (and FSDP's
reduce-scatter) average it over the W processes, giving dL/d(theta), serial's
gradient. Every process must run backward for the all-reduce to complete,
which every data-parallel step does.

With --grad-accum k each micro-step normalises one k-th of each share,
gathered over the processes: not the same samples as serial's k-th micro-
step, so accumulation with BatchNorm matches serial only with k = 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from torchfleet.errors import UsageError
from torchfleet.strategies import registry

_SYNCED = (nn.SyncBatchNorm,)  # and SyncBatchNorm below: already synchronised, left alone


class _AllReduceSum(torch.autograd.Function):
    """A differentiable all-reduce (SUM): its backward all-reduces the gradients (SUM).

    What torch.distributed.nn.functional.all_reduce does; torch 2.14 deprecates
    that (a FutureWarning on every call site) for a private module whose
    autograd support differs across the torch versions torchfleet supports.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllReduceSum.apply(grad, ctx.group), None


class SyncBatchNorm(_BatchNorm):
    """nn.BatchNorm1d/2d/3d whose training statistics are the whole data-parallel batch's.

    In eval mode, or with one process in its group, it is exactly the
    BatchNorm it replaced (the same `F.batch_norm` call).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        group=None,
        like: type[_BatchNorm] = nn.BatchNorm2d,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.group = group  # None: the default (WORLD) group
        self._like = like  # the replaced class, whose input-shape check this one keeps

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self._like._check_input_dim(self, input)

    def _world(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Eval mode uses the running statistics (or, without them, the share's own,
        # as torch's SyncBatchNorm does): nothing to synchronise.
        if not self.training or self._world() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

        # Statistics in fp32 at least, whatever autocast made the input (a float64 model keeps float64).
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        mean, var, n, centred = self._global_moments(x)
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight.to(x.dtype)
        shape = [1, x.size(1)] + [1] * (x.dim() - 2)
        bias = self.bias.to(x.dtype).view(shape) if self.bias is not None else torch.zeros((), device=x.device)
        out = torch.addcmul(bias, centred, scale.view(shape))

        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                # As ATen's kernel: momentum * batch + (1 - momentum) * running, unbiased variance.
                self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean)
                self.running_var.copy_(factor * var * (n / (n - 1)) + (1 - factor) * self.running_var)
        return out.to(input.dtype)

    def _global_moments(self, x: torch.Tensor):
        """(mean, biased variance, count, x - mean) per channel over every process's share.

        Two all-reduces, as serial computes them in two passes: the sum (and
        count) for the mean, then the squared deviations from it. One pass of
        sums of x and x*x would need one collective, but E[x^2] - mean^2 cancels
        where |mean| >> std: on inputs of mean 3 and std 1 (BatchNorm1d, 2
        processes) its outputs and input gradients were 3.5e-6 and 4.8e-6 from
        nn.BatchNorm's on the whole batch, against 2.4e-7 (float rounding) this way.
        """
        group = self.group or dist.group.WORLD
        channels = x.size(1)
        shape = [1, channels] + [1] * (x.dim() - 2)
        dims = [0, *range(2, x.dim())]
        sums = _AllReduceSum.apply(torch.cat([x.sum(dims), x.new_full((1,), x.numel() // channels)]), group)
        n = sums[-1].item()  # samples x positions per channel, over every process's share
        if n <= 1:  # F.batch_norm's own check, on the global batch
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size"
                f" {list(x.shape)} on each of {self._world()} processes"
            )
        mean = sums[:channels] / n
        centred = x - mean.view(shape)
        var = _AllReduceSum.apply((centred * centred).sum(dims), group) / n
        return mean, var, n, centred


def _synchronised(bn: _BatchNorm, group) -> SyncBatchNorm:
    """A SyncBatchNorm holding `bn`'s own Parameter and buffer objects."""
    # The ignore: torch's own _LazyProtocol says hooks return None where Module's return handles,
    # so no real module matches it as the checker reads it; the method is LazyModuleMixin's.
    if isinstance(bn, LazyModuleMixin) and bn.has_uninitialized_params():  # pyright: ignore[reportAttributeAccessIssue]
        raise UsageError(
            f"{type(bn).__name__} has not seen an input yet, so its size is unknown;"
            " run one forward before setup, or use BatchNorm with num_features"
        )
    new = SyncBatchNorm(
        bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, group=group, like=type(bn)
    )
    # The same objects, not copies: an optimizer built over the old ones still steps these.
    for name in ("weight", "bias"):
        new._parameters[name] = bn._parameters.get(name)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        new._buffers[name] = bn._buffers.get(name)
    new.train(bn.training)
    return new


def convert_sync_batchnorm(model: nn.Module, group=None) -> nn.Module:
    """Replace every BatchNorm in `model` with a SyncBatchNorm over `group`, in place; returns `model`.

    Module names stay, so state-dict keys are unchanged, and the weight,
    bias and running buffers are the same objects. A model that is itself a
    BatchNorm is returned replaced.
    """
    if isinstance(model, _BatchNorm) and not isinstance(model, (*_SYNCED, SyncBatchNorm)):
        return _synchronised(model, group)
    for name, child in model.named_children():
        converted = convert_sync_batchnorm(child, group)
        if converted is not child:
            setattr(model, name, converted)
    return model


def has_batchnorm(model: nn.Module | list[nn.Module]) -> bool:
    """Whether `model` (or any of a list of stages, as mp takes them) holds a BatchNorm."""
    stages = model if isinstance(model, (list, tuple)) else [model]
    return any(isinstance(m, _BatchNorm) for stage in stages for m in stage.modules())


def check_sync_batchnorm(pp: int, sync_batchnorm: bool) -> None:
    """Refuse --sync-batchnorm for pipelines: their statistics are per micro-batch, not per process."""
    if sync_batchnorm and pp > 1:
        raise UsageError(
            f"--sync-batchnorm does not apply to a pipeline (pp {pp}): each stage"
            " normalises one micro-batch at a time, so there are no whole-batch statistics"
            " to synchronise; drop --sync-batchnorm, or use ddp or fsdp without --pp"
        )


_ADVICE = "; pass --sync-batchnorm (sync_batchnorm=True) to normalise with the whole batch's, as serial does"


def _normalises_with(strategy_name: str) -> str | None:
    """What `strategy_name`'s BatchNorm normalises with, as its preset declares (registry.BATCHNORMS).

    A mesh class names itself by its degrees, which may make a name no preset has ("hsdp+pipeline"):
    a pipeline's micro-batches if one of its parts is a pipeline, else nothing to say.
    """
    preset = registry.find(strategy_name)
    if preset is not None:
        return preset.batchnorm
    parts = [registry.find(part) for part in strategy_name.split("+")]
    staged = any(part is not None and part.batchnorm == "stage micro-batches" for part in parts)
    return "stage micro-batches" if staged else None


def batchnorm_note(model: nn.Module | list[nn.Module], strategy_name: str, synced: bool) -> str | None:
    """One sentence on which statistics `model`'s BatchNorm layers normalise with; None without any.

    The whole batch (serial's) is the reference, so nothing to say.
    """
    kind = _normalises_with(strategy_name)
    if kind in (None, "whole batch") or not has_batchnorm(model):
        return None
    where = f"BatchNorm under {strategy_name}"
    if kind == "stage micro-batches":
        return (
            f"{where} normalises each micro-batch with its own statistics (--sync-batchnorm does"
            " not apply to pipelines), so its weights differ from serial's"
        )
    if kind == "shares":
        if synced:
            return (
                f"{where} normalises with the whole batch's statistics, all-reduced across the"
                " data-parallel processes (sync_batchnorm), as serial does"
            )
        return f"{where} normalises each process's share of the batch with that share's statistics{_ADVICE}"
    if kind == "chunks":
        return (
            f"{where}: nn.DataParallel's replicas normalise each GPU's chunk of the batch with that"
            " chunk's statistics and keep the first GPU's running statistics (on one device the whole"
            " batch, as serial)"
        )
    if kind == "micro-batches":
        return (
            f"{where} normalises each micro-batch with its own statistics, so its weights differ from"
            " serial's; --microbatches 1 normalises the whole batch, as serial does"
        )
    return (  # "own batches"
        f"{where}: each worker normalises its own batch and updates the shared running"
        " statistics without locks, so they are no single batch's"
    )
