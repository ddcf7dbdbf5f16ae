"""A training script written against the Fleet API.

The same file runs unchanged as:

    python examples/train_digits.py                       # one process
    torchfleet run -n 2 examples/train_digits.py          # 2 processes, DDP
    torchrun --nproc-per-node 2 examples/train_digits.py  # plain torchrun
    torchfleet slurm examples/train_digits.py --ntasks-per-node 2 --submit   # Slurm (srun tasks)
    as a SageMaker entry point, in a Kubeflow PyTorchJob (see docs/)

    --strategy NAME   serial, ddp, ...   (default ddp: serial when alone)
    --out FILE        save the final weights (main rank only; default in a
                      SageMaker job: model.pt in SM_MODEL_DIR)
"""

import argparse

import torch
from torch import nn

import torchfleet
from torchfleet.train.datasets import digits
from torchfleet.train.models import cnn

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="ddp")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--out", default=None)
args = parser.parse_args()

fleet = torchfleet.Fleet(strategy=args.strategy)
torch.manual_seed(0)  # the same initial weights everywhere
model = cnn()
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
model, optimizer = fleet.setup(model, optimizer)
loader = fleet.dataloader(digits("train"), batch_size=64, shuffle=True, seed=0)  # global batch
loss_fn = nn.CrossEntropyLoss()

for epoch in range(args.epochs):
    for inputs, targets in loader:
        loss = fleet.train_step(inputs, targets, loss_fn)
    fleet.print(f"epoch {epoch + 1}: loss {fleet.all_reduce(loss).item():.4f}")

if args.out or fleet.model_dir:  # in a SageMaker job the model goes to SM_MODEL_DIR
    fleet.save_model(args.out)  # every rank calls it; the main rank writes
fleet.close()
