"""ddp: one replica per process, gradients averaged by DistributedDataParallel.

DDP all-reduces gradient buckets during backward, overlapping communication
with computation, and every process steps its own optimizer on the same
averaged gradients, so no parameters are broadcast after the first step.
"""

from torch.nn.parallel import DistributedDataParallel as DDP

from torchfleet.strategies.base import Strategy


class DataParallelDistributed(Strategy):
    name = "ddp"
    distributed = True

    def wrap(self, model, optimizer):
        device = self.runtime.device
        model = model.to(device)
        # device_ids only for single-device CUDA modules; CPU modules take None.
        ids = [device] if device.type == "cuda" else None
        self.model = DDP(model, device_ids=ids)
        self.optimizer = optimizer
        return self.model, self.optimizer

    def unwrapped(self):
        return self.model.module

    def no_sync(self):
        # no_sync only toggles require_backward_grad_sync: the next backward
        # outside it all-reduces the gradients accumulated so far.
        return self.model.no_sync()
