"""What fsdp saves: bytes held per rank and peak memory, fsdp against ddp on the same job.

    python benchmarks/fsdp_memory.py                 # both strategies, 2 processes each, then the ratios
    torchfleet run -n 2 benchmarks/fsdp_memory.py --strategy fsdp --worker   # one of them

The job: the built-in `gpt` preset small50m (57M parameters), fp32 AdamW,
3 steps of 2 x 2 sequences of 256 tokens. Each rank reports:
- the parameter, gradient and optimizer-state bytes it holds (from its own
  tensors) after the steps;
- its peak tensor memory over the steps (`torchfleet.tensor_memory`: every
  tensor alive at once, the figure `torch.cuda.max_memory_allocated` gives
  on a GPU);
- its peak resident memory above what the process held before the model
  was built, which on CPU also counts the allocator's retained pages and
  Gloo's buffers.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(strategy: str, preset: str, steps: int) -> None:
    import torch

    from torchfleet import Fleet
    from torchfleet.models import gpt, lm_loss
    from torchfleet.tensor_memory import TensorMemory

    fleet = Fleet(strategy=strategy)
    before = rss_peak_bytes()
    torch.manual_seed(0)
    model = gpt(preset)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fleet.setup(model, optimizer)
    block = model.config.block_size if hasattr(model, "config") else 256
    tokens = torch.randint(0, 256, (2 * fleet.world_size, block + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens[fleet.rank * 2:(fleet.rank + 1) * 2]
    with TensorMemory(model, optimizer) as tensors:
        for _ in range(steps):
            tensors.next_step()
            fleet.train_step(mine[:, :-1], mine[:, 1:], lm_loss)
    held = fleet.strategy.memory_report()
    if held is None:  # ddp keeps whole copies: count them the same way
        from torchfleet.strategies.fsdp import memory_per_rank

        ps = list(model.parameters())
        held = memory_per_rank(ps, [p.grad for p in ps], optimizer)
    peak = fleet.all_reduce(rss_peak_bytes() - before, op="max").item()
    tensor_peak = fleet.all_reduce(tensors.peak_bytes(fleet.device), op="max").item()
    if fleet.is_main:
        print(json.dumps({"strategy": strategy, "parameters": params, "held": held["rank 0"],
                          "tensor_peak": tensor_peak, "peak_above_start": peak}))
    fleet.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default=None, choices=("ddp", "fsdp"))
    parser.add_argument("--preset", default="small50m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.strategy, args.preset, args.steps)
        return
    rows = {}
    for strategy in ([args.strategy] if args.strategy else ["ddp", "fsdp"]):
        out = subprocess.run([sys.executable, "-m", "torchfleet", "run", "-n", "2", __file__, "--worker",
                              "--strategy", strategy, "--preset", args.preset, "--steps", str(args.steps)],
                             capture_output=True, text=True, check=True).stdout
        rows[strategy] = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    mib = 2 ** 20
    for strategy, row in rows.items():
        held = sum(row["held"].values())
        ideal = 16 * row["parameters"] / (2 if strategy == "fsdp" else 1)
        print(f"{strategy:5s} {row['parameters'] / 1e6:.1f}M parameters: held {held / mib:8.1f} MiB per rank"
              f" ({held / ideal:.3f} x 16 B x P{' / 2' if strategy == 'fsdp' else ''}),"
              f" tensor peak {row['tensor_peak'] / mib:8.1f} MiB,"
              f" resident peak {row['peak_above_start'] / mib:8.1f} MiB above start")
    if len(rows) == 2:
        fsdp, ddp = rows["fsdp"], rows["ddp"]
        print(f"fsdp / ddp: held {sum(fsdp['held'].values()) / sum(ddp['held'].values()):.3f},"
              f" tensor peak {fsdp['tensor_peak'] / ddp['tensor_peak']:.3f},"
              f" resident peak {fsdp['peak_above_start'] / ddp['peak_above_start']:.3f}")


if __name__ == "__main__":
    main()
