"""A Fleet script for launcher tests: trains a few steps, saves the weights, and reports
which addresses the process that started it listens on (when that is torchrun's agent).

    python fleet_job.py --out W.pt [--listening FILE]
"""

import argparse
import os

import torch
from torch import nn

import torchfleet
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import mlp

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--listening", default=None, help="write the agent's listening addresses here")
args = parser.parse_args()


def listening_addresses(pid: int) -> list[str]:
    """host:port of every TCP socket `pid` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                found.append(fields[1])
    return found


fleet = torchfleet.Fleet(strategy="ddp")
if args.listening and fleet.is_main and "TORCHELASTIC_RUN_ID" in os.environ:
    with open(args.listening, "w") as fh:
        fh.write("\n".join(listening_addresses(os.getppid())))
torch.manual_seed(0)  # the same initial weights on every rank, under every launcher
net = mlp()
model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
loader = fleet.dataloader(synthetic(32 * 6, shape=(1, 8, 8), seed=0), batch_size=32, seed=0)  # global batch
for inputs, targets in loader:
    fleet.train_step(inputs, targets, nn.CrossEntropyLoss())
if fleet.is_main:
    torch.save(fleet.strategy.unwrapped().state_dict(), args.out)
fleet.close()
