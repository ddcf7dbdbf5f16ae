"""What fsdp saves: bytes held per rank and peak memory, fsdp against ddp on the same job.

    python benchmarks/fsdp_memory.py                 # both strategies, 2 processes each, then the ratios
    python benchmarks/fsdp_memory.py --strategy fsdp # one of them

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

from torchfleet import launch
from torchfleet.testing.real_models import memory_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default=None, choices=("ddp", "fsdp"))
    parser.add_argument("--preset", default="small50m")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    for strategy in [args.strategy] if args.strategy else ["ddp", "fsdp"]:
        # One launch per strategy: a process's resident peak cannot be reset.
        rows[strategy] = launch(memory_job, nprocs=2, args=([strategy], args.preset, args.steps))[0][strategy]
    mib = 2**20
    for strategy, row in rows.items():
        held = sum(row["held"]["rank 0"].values())
        ideal = 16 * row["parameters"] / (2 if strategy == "fsdp" else 1)
        print(
            f"{strategy:5s} {row['parameters'] / 1e6:.1f}M parameters: held {held / mib:8.1f} MiB per rank"
            f" ({held / ideal:.3f} x 16 B x P{' / 2' if strategy == 'fsdp' else ''}),"
            f" tensor peak {max(row['peak']) / mib:8.1f} MiB,"
            f" resident peak {max(row['resident']) / mib:8.1f} MiB above start"
        )
    if len(rows) == 2:
        fsdp, ddp = rows["fsdp"], rows["ddp"]
        print(
            f"fsdp / ddp: held {sum(fsdp['held']['rank 0'].values()) / sum(ddp['held']['rank 0'].values()):.3f},"
            f" tensor peak {max(fsdp['peak']) / max(ddp['peak']):.3f},"
            f" resident peak {max(fsdp['resident']) / max(ddp['resident']):.3f}"
        )


if __name__ == "__main__":
    main()
