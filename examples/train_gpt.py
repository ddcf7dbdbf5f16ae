"""A small GPT on text that ships with scikit-learn, any strategy by one word.

    python examples/train_gpt.py                                   # one process
    torchfleet run -n 2 examples/train_gpt.py --strategy fsdp      # parameters sharded per block
    torchfleet run -n 2 examples/train_gpt.py --strategy pipeline  # cut between blocks, traced
    torchfleet run -n 4 examples/train_gpt.py --strategy fsdp+pipeline
    torchfleet run -n 2 examples/train_gpt.py --strategy tp        # the model's tensor-parallel plan

    --strategy NAME         serial, dp, mp, ddp, fsdp, hsdp, pipeline, ddp+pipeline, fsdp+pipeline, ...
    --preset NAME           tiny (default, seconds on a laptop), small50m, gpt2 (124M, for GPUs)
    --max-grad-norm NORM    clip gradients to this global norm (default 1.0)
    --checkpointing         recompute each block's activations in backward
    --compile               torch.compile each block

The model is `torchfleet.models.GPT` (blocks in an nn.ModuleList): nothing in
this script depends on the strategy. A Hugging Face model works the same way:
pass it to `fleet.setup` and its inputs as a dict (``fleet.train_step({"input_ids": x}, ...)``).
"""

import argparse
import math

import torch

import torchfleet
from torchfleet.models import gpt, lm_loss
from torchfleet.train.text import text

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="ddp")
parser.add_argument("--preset", default="tiny")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--max-grad-norm", type=float, default=1.0)
parser.add_argument("--checkpointing", action="store_true")
parser.add_argument("--compile", action="store_true")
args = parser.parse_args()

fleet = torchfleet.Fleet(strategy=args.strategy, max_grad_norm=args.max_grad_norm,
                         activation_checkpointing=args.checkpointing, compile=args.compile)
torch.manual_seed(0)  # the same initial weights everywhere
model = gpt(args.preset)
block = model.config.block_size
train, val = text("train", block), text("val", block)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = fleet.dataloader(train, batch_size=args.batch_size, shuffle=True, seed=0)  # global batch
example = torch.stack([train[i][0] for i in range(loader.batch_sampler.local_batch)])
model, optimizer = fleet.setup(model, optimizer, example_inputs=example)  # pipelines trace with it
for note in fleet.notes:
    fleet.print(f"note: {note}")

for epoch in range(args.epochs):
    for step, (inputs, targets) in enumerate(loader):
        loss = fleet.train_step(inputs, targets, lm_loss)
        if step % 20 == 0:
            fleet.print(f"epoch {epoch + 1} step {step}: loss {loss.item():.3f}")
    total = count = 0.0
    for inputs, targets in fleet.eval_dataloader(val, batch_size=64):
        logits = fleet.predict(inputs)
        if logits is not None:  # pipeline stages before the last return None
            total += lm_loss(logits, fleet.to_device(targets)).item() * len(inputs)
            count += len(inputs)
    total, count = fleet.all_reduce(torch.tensor([total, count]), op="sum").tolist()
    fleet.print(f"epoch {epoch + 1}: validation loss {total / count:.3f}, perplexity {math.exp(total / count):.1f}")
fleet.close()
