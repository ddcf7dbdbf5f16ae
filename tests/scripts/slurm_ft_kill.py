"""A Fleet script for a replica group under Slurm: trains a few steps, and a fault may kill it.

    TORCHFLEET_FAULT=kill:rank=0:step=2:once=FILE torchfleet run --fault-tolerance step ... slurm_ft_kill.py

After every step it asks torchfleet's fault hook (train/faults.py) whether to fire: with `once=FILE`
the first attempt's rank 0 is SIGKILLed after step 2 and writes FILE, so the attempt that the job
script starts again trains to the end and prints "trained N steps" (the steps this attempt took).
--batches sets the length (6): with a few thousand, a group started again while another trains
heals from it.
"""

import argparse

import torch
from torch import nn

import torchfleet
from torchfleet.train import faults
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import mlp

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=6, help="steps to train (default 6)")
args = parser.parse_args()

fleet = torchfleet.Fleet(strategy="ddp")
torch.manual_seed(0)
net = mlp()
model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
loader = fleet.dataloader(synthetic(32 * args.batches, shape=(1, 8, 8), seed=0), batch_size=32, seed=0)
steps = 0
for inputs, targets in loader:
    fleet.train_step(inputs, targets, nn.CrossEntropyLoss())
    steps += 1
    faults.maybe_fire(fleet.rank, steps)
fleet.print(f"trained {steps} steps")
fleet.close()
