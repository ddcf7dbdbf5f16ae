"""ddp: one replica per process, gradients averaged by DistributedDataParallel.

The preset ``dp_replicate = N`` of the parallel dimensions (strategies/dims.py).

DDP all-reduces gradient buckets during backward, overlapping communication
with computation, and every process steps its own optimizer on the same
averaged gradients, so no parameters are broadcast after the first step.

Option `grad_compression` installs one of torch's DDP communication hooks
(torch.distributed.algorithms.ddp_comm_hooks) on the gradient buckets:
fp16 / bf16 halve the bytes on the wire (cast, all-reduce, cast back);
powersgd sends a rank-`powersgd_rank` approximation of each gradient matrix
(Vogels et al., 2019) with error feedback, which pays on slow links.
"""

import functools

from torch.nn.parallel import DistributedDataParallel

from torchfleet.errors import UsageError, choice_error
from torchfleet.strategies.distributed import MeshStrategy
from torchfleet.strategies.options import StrategyOptions
from torchfleet.strategies.parallelize import apply_ddp, parallelize

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
# PowerSGD runs plain all-reduce before this step; with error feedback torch
# requires at least 2. Kept at the minimum so short jobs are compressed too.
POWERSGD_START = 2


def _in_bucket_order(hook):
    """Run `hook` one gradient bucket at a time.

    PowerSGD issues a bucket's second all-reduce (Q) from a callback of its first (P), on a
    communication thread, while backward goes on issuing the next bucket's all-reduces. The
    interleaving then differs between ranks, and Gloo, which matches collectives by order,
    fails ("Received data size doesn't match expected size") or hangs. Waiting for the
    previous bucket before starting the next keeps one order everywhere, at the cost of
    overlapping PowerSGD's buckets with each other.
    """
    previous = []

    @functools.wraps(hook)  # DDP's logging names the hook it runs: keep PowerSGD's name
    def ordered(state, bucket):
        if bucket.index() > 0 and previous:
            previous[-1].wait()
        previous[:] = [hook(state, bucket)]
        return previous[0]

    return ordered


class DataParallelDistributed(MeshStrategy):
    takes = (*MeshStrategy.takes, "grad_compression", "powersgd_rank", "find_unused_parameters")
    model: DistributedDataParallel  # what wrap makes: its .module, comm hooks and no_sync are used below

    def __init__(self, runtime, options: StrategyOptions | None = None, dims=None):
        # Its own options first: they are checked before any process group exists.
        options = options or StrategyOptions()
        grad_compression = options.compression.grad_compression or "none"
        self.find_unused_parameters = bool(options.replication.find_unused_parameters)
        self._checked = self.find_unused_parameters  # nothing to check when DDP looks for them itself
        powersgd_rank = options.compression.powersgd_rank
        if grad_compression not in COMPRESSIONS:
            raise choice_error("gradient compression", grad_compression, COMPRESSIONS)
        if powersgd_rank is not None and grad_compression != "powersgd":
            raise UsageError(
                f"--powersgd-rank {powersgd_rank} needs --grad-compression powersgd (not {grad_compression})"
            )
        if powersgd_rank is not None and powersgd_rank < 1:
            raise UsageError(f"--powersgd-rank {powersgd_rank} must be at least 1")
        super().__init__(runtime, options, dims)  # refuses options ddp does not take
        self.grad_compression = grad_compression
        self.powersgd_rank = powersgd_rank or 2

    def wrap(self, model, optimizer, args):
        model = self.synchronise_batchnorm(model)  # before DDP: it registers the modules' parameters
        mesh = self.build_mesh()
        self.balance_router_loss(model, mesh)
        made = parallelize(
            model,
            dims=self.dims,
            mesh=mesh,
            device=self.runtime.device,
            precision=self.runtime.precision,
            find_unused_parameters=self.find_unused_parameters,
        )
        runner, self.step_contexts = made.runner, made.step_contexts
        # parallelize wraps from 2 replicas on; one that was asked for (alone) is wrapped too
        self.model = (
            runner
            if isinstance(runner, DistributedDataParallel)
            else apply_ddp(runner, mesh["dp_replicate"], self.runtime.device, self.find_unused_parameters)
        )
        self._register_hook(mesh["dp_replicate"].get_group())
        self.optimizer = optimizer
        return self.model, self.optimizer

    def before_step(self) -> None:
        """After the first backward: every trainable parameter must have a gradient.

        A parameter the forward never uses (a library model's pooler or spare
        head) leaves its DDP bucket unfinished: the gradients in that bucket are
        not averaged, and the next forward fails with "Expected to have finished
        reduction". Said here, before the first step could apply them.
        """
        if self._checked:
            return
        self._checked = True
        unused = [n for n, p in self.model.module.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise UsageError(
                f"ddp: the forward did not use {len(unused)} parameters ({shown}), so DDP cannot"
                " average the gradients; pass find_unused_parameters=True"
                " (--find-unused-parameters), or set requires_grad=False on them"
            )

    def _register_hook(self, group) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.grad_compression == "fp16":
            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.grad_compression == "bf16":
            self.model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif self.grad_compression == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=group, matrix_approximation_rank=self.powersgd_rank, start_powerSGD_iter=POWERSGD_START
            )
            self.model.register_comm_hook(state, _in_bucket_order(powerSGD_hook.powerSGD_hook))

    def unwrapped(self):
        return self.model.module

    def no_sync(self):
        # no_sync only toggles require_backward_grad_sync: the next backward
        # outside it all-reduces the gradients accumulated so far.
        return self.model.no_sync()
