"""Save checkpoints of a 32 MiB model until killed (file and DCP layouts in turn); every weight equals its step.

python save_loop.py DIR FIRST_STEP
"""

import sys

import torch

import torchfleet
from torchfleet import checkpoint

directory, step = sys.argv[1], int(sys.argv[2])
fleet = torchfleet.Fleet(strategy="serial")
net = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
while True:
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float(step))
    fleet.save(checkpoint.step_path(directory, step), sharded=step % 2 == 0, step=step)  # both layouts
    checkpoint.prune(directory, 2)
    print(f"saved {step}", flush=True)
    step += 1
