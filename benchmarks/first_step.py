"""Time to the first training step: one Fleet step, then rank 0 writes
the wall clock at its start and after that step to STAMP.

    torchfleet run -n 2 benchmarks/first_step.py STAMP
    torchrun --standalone --nproc-per-node 2 benchmarks/first_step.py STAMP
"""

import time

STARTED = time.time()  # the worker's interpreter is up: what follows is imports and set-up

import sys  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torchfleet import Fleet  # noqa: E402
from torchfleet.train.models import mlp  # noqa: E402

fleet = Fleet(strategy="ddp")
torch.manual_seed(0)
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
fleet.setup(model, optimizer)
inputs, targets = torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,))
fleet.train_step(inputs, targets, nn.CrossEntropyLoss())
if fleet.is_main:
    with open(sys.argv[1], "w") as fh:
        fh.write(f"{STARTED!r} {time.time()!r}")
fleet.close()
