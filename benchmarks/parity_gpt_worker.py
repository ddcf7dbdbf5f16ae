"""The built-in gpt trained up to four ways under one strategy, interleaved in one set of processes.

    torchrun --standalone --nproc-per-node 2 benchmarks/parity_gpt_worker.py --strategy fsdp --out DIR \
        [--ways hand,torchfleet,accelerate,fabric] [--preset small50m] [--global-batch 16] [--blocks 12] \
        [--block-steps 4]

The ways: hand (the strategy written directly against torch: DistributedDataParallel;
FSDP2's fully_shard on each block, then the root; a pipeline of two stages cut by hand
at the middle block, run by torch.distributed.pipelining's 1F1B schedule), torchfleet
(Fleet(strategy) on the same model), and, under ddp and fsdp, Hugging Face Accelerate and
Lightning Fabric (benchmarks/parity_gpt_peers.py says which of their APIs; neither has a
pipeline strategy). All start from the same weights, read the same global batches (token
sequences, the next token as the target) and step AdamW; they take turns in blocks of steps
(A B C D A B C D ...), so a busy machine's drift hits all alike. A peer that is not installed
or fails to set up is left out on every rank, with one line saying why. Rank 0 writes
DIR/steps.json (step times per way, warm-up blocks left out, and the peers left out) and
DIR/weights.json (per way, the largest difference between its final weights and the
hand-written way's, and how many were compared).
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
from parity_gpt_peers import PEERS, full_weights, largest_difference, make
from torch import nn

from torchfleet.models.gpt import gpt, lm_loss

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--strategy", choices=("ddp", "fsdp", "pipeline"), required=True)
parser.add_argument(
    "--ways",
    default="hand,torchfleet,accelerate,fabric",
    help="hand and torchfleet always run; accelerate and fabric under ddp and fsdp",
)
parser.add_argument("--preset", default="small50m")
parser.add_argument("--global-batch", type=int, default=16)
parser.add_argument("--microbatches", type=int, default=4, help="pipeline: micro-batches per step")
parser.add_argument("--blocks", type=int, default=12)
parser.add_argument("--block-steps", type=int, default=4)
parser.add_argument("--warmup-blocks", type=int, default=2)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

dist.init_process_group("gloo")
WORLD, RANK = dist.get_world_size(), dist.get_rank()
torch.manual_seed(args.seed)
INITIAL = gpt(args.preset)
T = INITIAL.config.block_size
STEPS = args.blocks * args.block_steps
tokens = torch.randint(
    0, INITIAL.config.vocab_size, (args.global_batch * STEPS, T + 1), generator=torch.Generator().manual_seed(args.seed)
)
DATA = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
# The order torchfleet's GlobalBatchSampler draws for epoch 0 (rank r reads the r-th slice of
# each global batch; a pipeline's ranks all read the whole batch).
ORDER = torch.randperm(len(DATA), generator=torch.Generator().manual_seed(args.seed * 100003))
READERS = 1 if args.strategy == "pipeline" else WORLD
LOCAL = args.global_batch // READERS


def optimizer_for(params):
    return torch.optim.AdamW(params, lr=3e-4)


def hand_batches():
    reader = 0 if READERS == 1 else RANK
    for k in range(len(DATA) // args.global_batch):
        lo = k * args.global_batch + reader * LOCAL
        yield DATA[ORDER[lo : lo + LOCAL]]


def hand():
    """Returns (step, full weights this rank holds by name)."""
    net = copy.deepcopy(INITIAL)
    it = hand_batches()
    if args.strategy == "pipeline":
        return hand_pipeline(net, it)
    if args.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net)
        weights = net.state_dict
    else:
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)  # in place: net's own forward, now over shards
        model = net

        def weights():
            return full_weights(net)

    optimizer = optimizer_for(net.parameters())

    def step():
        x, y = next(it)
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        optimizer.step()

    return step, weights


class Half(nn.Module):
    """One stage of the hand-cut pipeline: it keeps the whole model's attributes (so its weights keep
    the model's names) and runs the first or the second half of the blocks."""

    def __init__(self, net, first: bool):
        super().__init__()
        self.net, self.first = net, first
        cut = len(net.blocks) // 2
        self.mine = range(cut) if first else range(cut, len(net.blocks))

    def forward(self, x):
        net = self.net
        if self.first:
            x = net.tok_emb(x) + net.pos_emb(torch.arange(x.shape[1]))
        for i in self.mine:
            x = net.blocks[i](x)
        return x if self.first else net.head(net.norm(x))

    def owned(self) -> dict:
        """The parameters this stage trains, by the model's names."""
        top = ("tok_emb.", "pos_emb.") if self.first else ("norm.", "head.")
        blocks = tuple(f"blocks.{i}." for i in self.mine)
        return {n: p for n, p in self.net.named_parameters() if n.startswith(top + blocks)}


def hand_pipeline(net, it):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    assert WORLD == 2, "the hand-cut pipeline has two stages"
    half = Half(net, first=RANK == 0)
    owned = half.owned()
    for name, p in net.named_parameters():
        p.requires_grad_(name in owned)
    stage = PipelineStage(half, RANK, WORLD, torch.device("cpu"))
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=lm_loss)
    optimizer = optimizer_for(list(owned.values()))

    def step():
        x, y = next(it)
        optimizer.zero_grad(set_to_none=True)
        if RANK == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()

    return step, lambda: {n: p.detach().clone() for n, p in half.owned().items()}


def torchfleet_way():
    from torchfleet import Fleet

    options = {"microbatches": args.microbatches} if args.strategy == "pipeline" else {}
    fleet = Fleet(args.strategy, **options)
    net = copy.deepcopy(INITIAL)
    optimizer = optimizer_for(net.parameters())
    example = DATA[ORDER[: args.global_batch // READERS]][0]
    fleet.setup(net, optimizer, example_inputs=example)
    it = iter(fleet.dataloader(DATA, args.global_batch, shuffle=True, seed=args.seed))

    def step():
        x, y = next(it)
        fleet.train_step(x, y, lm_loss)

    return step, lambda: fleet.strategy.state_dicts()[0]


def peers() -> tuple[dict, dict[str, str]]:
    """The peers asked for, each (step, weights), and those left out with why."""
    asked = [w for w in args.ways.split(",") if w in PEERS]
    if args.strategy == "pipeline":
        return {}, dict.fromkeys(asked, "no pipeline strategy")
    made, left_out = {}, {}
    for name in asked:
        way, why = make(name, args.strategy, copy.deepcopy(INITIAL), optimizer_for, hand_batches())
        if way is None:
            left_out[name] = why
            if RANK == 0:
                print(f"parity_gpt_worker: {name} left out under {args.strategy}: {why}", flush=True)
        else:
            made[name] = way
    return made, left_out


ways = {"hand": hand(), "torchfleet": torchfleet_way()}
made, left_out = peers()
ways.update(made)
times = take_turns({name: step for name, (step, _) in ways.items()}, args.blocks, args.block_steps, args.warmup_blocks)

# Compare the weights each rank can see: the hand pipeline's rank holds its stage's, by the model's names.
mine = ways["hand"][1]()
# The others' full state dicts (every rank, or rank 0); in the same order on every rank, as these are collectives.
theirs = {name: weights() for name, (_, weights) in ways.items() if name != "hand"}
gathered: list = [None] * WORLD
dist.all_gather_object(gathered, {n: t.detach().cpu() for n, t in mine.items()})
if RANK == 0:
    hand_weights = {n: t for part in gathered for n, t in part.items()}
    differences = {name: largest_difference(hand_weights, w) for name, w in theirs.items()}
    # How far training moved them: equal weights that never moved prove nothing.
    moved, _ = largest_difference(INITIAL.state_dict(), hand_weights)
    out = Path(args.out)
    (out / "steps.json").write_text(
        json.dumps(
            {
                "strategy": args.strategy,
                "world_size": WORLD,
                "global_batch": args.global_batch,
                "preset": args.preset,
                "step_times": times,
                "left_out": left_out,
            }
        )
    )
    (out / "weights.json").write_text(
        json.dumps(
            {
                "max_abs_difference": {name: d for name, (d, _) in differences.items()},
                "compared": {name: n for name, (_, n) in differences.items()},
                "hand": len(hand_weights),
                "moved": moved,
            }
        )
    )
dist.barrier()
sys.stdout.flush()
os._exit(0)  # as parity_worker.py: no Gloo teardown after the figures are written
