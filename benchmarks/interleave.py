"""Timing contenders in turns: the parity workers' loop (parity_worker.py, parity_gpt_worker.py)."""

import time

import torch.distributed as dist


def take_turns(steps: dict, blocks: int, block_steps: int, warmup_blocks: int) -> dict[str, list[float]]:
    """Run each of `steps` (name -> a function doing one training step) for `block_steps` steps in
    turn (A B C A B C ...), `blocks` times; each step's seconds per name, fetching its batch included,
    the first `warmup_blocks` blocks left out. Turns make a busy machine's drift hit every contender alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for block in range(blocks):
        for name, step in steps.items():
            if dist.is_initialized():
                dist.barrier()  # each block starts with every rank ready
            tick = time.perf_counter()
            for _ in range(block_steps):
                step()
                now = time.perf_counter()
                if block >= warmup_blocks:
                    times[name].append(now - tick)
                tick = now
    return times
