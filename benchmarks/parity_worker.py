"""One training job, written up to four ways, interleaved in one set of processes.

    torchrun --standalone --nproc-per-node 2 benchmarks/parity_worker.py --out DIR \
        [--ways hand,torchfleet,accelerate,fabric] [--global-batch 256] [--blocks 20] [--block-steps 10]

The ways: hand (a hand-written DistributedDataParallel loop), torchfleet,
accelerate (Hugging Face Accelerate) and fabric (Lightning Fabric); and two
that measure the machine rather than train (`unsynced`): free and lockstep. Each
trains its own copy of the same CNN from the same initial weights on the same
in-memory data, with the same global batch, optimizer and one intra-op thread
per process, in one process group: the hand-written loop starts it, and
torchfleet, Accelerate and Fabric each join a group that is already there.
The ways take turns in blocks of steps (A B C D A B C D ...), so drift on a
busy machine hits all alike. Each step is timed, fetching its batch included;
rank 0 writes DIR/steps.json (step times per way, warm-up blocks left out)
and DIR/hand.pt, DIR/torchfleet.pt (final weights: equal bit for bit).
"""

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from interleave import take_turns  # benchmarks/, on the path as the script's folder
from torch import nn
from torch.utils.data import DataLoader

from torchfleet.train.datasets import synthetic
from torchfleet.train.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--ways", default="hand,torchfleet,accelerate,fabric")
parser.add_argument("--model", default="cnn")
parser.add_argument("--global-batch", type=int, default=256)
parser.add_argument("--blocks", type=int, default=20)
parser.add_argument("--block-steps", type=int, default=10)
parser.add_argument("--warmup-blocks", type=int, default=2)
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.set_num_threads(args.threads)
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
LOCAL = args.global_batch // WORLD
STEPS = args.blocks * args.block_steps
data = synthetic(args.global_batch * STEPS, shape=(1, 8, 8), seed=args.seed)
torch.manual_seed(args.seed)
INITIAL = build_model(args.model, (1, 8, 8), 10)  # every way starts from a copy of these weights
loss_fn = nn.CrossEntropyLoss()
if WORLD > 1:
    dist.init_process_group("gloo")


def fresh():
    net = copy.deepcopy(INITIAL)
    return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def hand():
    from torch.nn.parallel import DistributedDataParallel as DDP

    net, optimizer = fresh()
    model = DDP(net) if WORLD > 1 else net
    inputs, targets = data.tensors
    # The permutation torchfleet's GlobalBatchSampler draws for epoch 0, and its
    # split: rank r takes the r-th contiguous slice of every global batch.
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(args.seed * 100003))

    def batches():
        for k in range(len(inputs) // args.global_batch):
            idx = order[k * args.global_batch + RANK * LOCAL : k * args.global_batch + (RANK + 1) * LOCAL]
            yield inputs[idx], targets[idx]

    it = batches()

    def step():
        x, y = next(it)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step, net


def torchfleet_way():
    from torchfleet import Fleet

    fleet = Fleet("ddp" if WORLD > 1 else "serial")
    net, optimizer = fresh()
    fleet.setup(net, optimizer)
    it = iter(fleet.dataloader(data, args.global_batch, shuffle=True, seed=args.seed))

    def step():
        x, y = next(it)
        fleet.train_step(x, y, loss_fn)

    return step, net


def accelerate_way():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net, optimizer = fresh()
    model, opt, loader = accelerator.prepare(net, optimizer, DataLoader(data, batch_size=LOCAL, shuffle=True))
    it = iter(loader)

    def step():
        x, y = next(it)
        opt.zero_grad()
        accelerator.backward(loss_fn(model(x), y))
        opt.step()

    return step, net


def fabric_way():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp" if WORLD > 1 else "auto")
    fabric.launch()  # under torchrun: joins the running processes, starts none
    net, optimizer = fresh()
    model, opt = fabric.setup(net, optimizer)
    it = iter(fabric.setup_dataloaders(DataLoader(data, batch_size=LOCAL, shuffle=True)))

    def step():
        x, y = next(it)
        opt.zero_grad()
        fabric.backward(loss_fn(model(x), y))
        opt.step()

    return step, net


def unsynced(lockstep: bool):
    """The hand-written step without DDP: each rank trains alone on its own slice.

    Not a way to train (the replicas drift apart); it measures the machine.
    free: no communication at all, what 2 independent processes reach.
    lockstep: one 4-byte all-reduce per step, no gradients: the least any
    synchronous data-parallel step pays here (waiting for the slower rank,
    and waking up when its message comes).
    """
    net, optimizer = fresh()
    inputs, targets = data.tensors
    token = torch.zeros(1)
    k = [0]

    def step():
        lo = k[0] * args.global_batch + RANK * LOCAL
        x, y = inputs[lo : lo + LOCAL], targets[lo : lo + LOCAL]
        k[0] += 1
        optimizer.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        if lockstep and WORLD > 1:
            dist.all_reduce(token)
        optimizer.step()

    return step, net


MAKERS = {
    "hand": hand,
    "free": lambda: unsynced(False),
    "lockstep": lambda: unsynced(True),
    "torchfleet": torchfleet_way,
    "accelerate": accelerate_way,
    "fabric": fabric_way,
}
ways = {name: MAKERS[name]() for name in args.ways.split(",")}
times = take_turns({name: step for name, (step, _) in ways.items()}, args.blocks, args.block_steps, args.warmup_blocks)

if RANK == 0:
    out = Path(args.out)
    (out / "steps.json").write_text(
        json.dumps({"world_size": WORLD, "global_batch": args.global_batch, "step_times": times})
    )
    for name in ("hand", "torchfleet"):
        if name in ways:
            torch.save(ways[name][1].state_dict(), out / f"{name}.pt")
if WORLD > 1:
    dist.barrier()
# No destroy_process_group: Gloo's teardown can abort a finished job at exit
# ("terminate called without an active exception"), failing a round whose
# figures are already written. Leave at once, as torchfleet train's workers do.
sys.stdout.flush()
os._exit(0)
