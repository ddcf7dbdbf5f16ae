"""Every rank prints LINES lines at once, each line one print of many pieces.

    torchfleet run -n 2 print_lines.py LINES

A line reads "rank R line I w w ... w" (20 w's): a print of 24 arguments, which
unbuffered output writes as 48 pieces. The ranks start together (a barrier) and
pause a millisecond every 10 lines, as a training log would, so their output
overlaps for its whole length instead of one rank finishing first.
"""

import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
for i in range(int(sys.argv[1])):
    print("rank", rank, "line", i, *["w"] * 20)
    if i % 10 == 9:
        time.sleep(0.001)
dist.destroy_process_group()
