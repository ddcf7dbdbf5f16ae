"""A Fleet script for replica groups: trains a few steps of the MLP on synthetic data.

    torchfleet run --fault-tolerance step ... ft_seeds.py [--seed-by-group]

--seed-by-group builds each group's model from another seed, which Fleet must refuse.
"""

import argparse
import os

import torch
from torch import nn

import torchfleet
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import mlp

parser = argparse.ArgumentParser()
parser.add_argument("--seed-by-group", action="store_true")
args = parser.parse_args()

fleet = torchfleet.Fleet(strategy="ddp")
torch.manual_seed(int(os.environ["TORCHFLEET_REPLICA_GROUP"]) if args.seed_by_group else 0)
net = mlp()
model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
loader = fleet.dataloader(synthetic(32 * 6, shape=(1, 8, 8), seed=0), batch_size=32, seed=0)
for inputs, targets in loader:
    fleet.train_step(inputs, targets, nn.CrossEntropyLoss())
fleet.close()
