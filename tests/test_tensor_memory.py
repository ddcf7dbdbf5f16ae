"""TensorMemory: the peak of the tensors a process holds, as `plan --check` reads a real rank's and plan's traces a
fake one's.

In a rank's process every tensor alive when it opens counts (a pipeline schedule's receive buffers, made at the first
step, were missed when only the model, the optimizer and modules' inputs were), and in a process others share (the
planner's profile, a test) only what it is given and what is made while it is open; a fake trace counts its own fake mode's tensors and
none of the planner's real ones; and what a pipeline's schedule does (a stage's second forward in a step, the zero
bubble schedules' input gradients by autograd.grad) is followed, where MemTracker's module hooks refused both.
"""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from torchfleet.tensor_memory import TensorMemory

KIB = 1024


# In a fresh process, as a rank's is: in pytest's, the tensors earlier tests left to other threads and caches (134 MB
# of them once) came and went between the two opens, and the difference was theirs too.
WHOLE_PROCESS = """
import torch
from torchfleet.tensor_memory import TensorMemory

def peak_while(inside, whole_process=True):
    with TensorMemory(whole_process=whole_process) as memory:
        inside()
    return memory.peak_bytes("cpu")

kept = [torch.zeros(64 * 1024, dtype=torch.uint8)]
with_it = peak_while(lambda: torch.ones(16 * 1024, dtype=torch.uint8))
shared = peak_while(lambda: torch.ones(16 * 1024, dtype=torch.uint8), whole_process=False)
kept.clear()
without_it = peak_while(lambda: torch.ones(16 * 1024, dtype=torch.uint8))
print(with_it - without_it, shared)
"""


def test_a_tensor_made_before_it_opens_counts_in_a_ranks_process_though_nothing_names_it():
    done = subprocess.run([sys.executable, "-c", WHOLE_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    difference, shared = map(int, done.stdout.split())
    assert difference == 64 * KIB
    assert shared == 16 * KIB  # a shared process: what was made while it was open, alone


def test_a_fake_trace_counts_its_own_fake_tensors_and_not_the_real_ones_alive():
    real = torch.zeros(4 * 1024 * KIB, dtype=torch.uint8)  # 4 MiB of the planner's own
    with FakeTensorMode():
        made = torch.zeros(256 * KIB, dtype=torch.uint8)
        with TensorMemory() as memory:
            torch.ones(128 * KIB, dtype=torch.uint8)
    assert memory.peak_bytes("cpu") == 256 * KIB + 128 * KIB
    assert real.numel() and made.numel()


def test_a_second_forward_in_a_step_and_input_gradients_by_autograd_grad_are_followed():
    stage = nn.Linear(256, 256, bias=False)  # 256 KiB of weights
    x = torch.randn(64, 256, requires_grad=True)  # 64 KiB
    with TensorMemory(stage) as memory:
        outs = [stage(x) for _ in range(2)]  # two micro-batches in flight: 64 KiB each, held
        (grad,) = torch.autograd.grad(sum(o.sum() for o in outs), x)  # a zero bubble schedule's split backward
    assert grad.shape == x.shape
    peak = memory.peak_bytes("cpu")
    assert peak >= 256 * KIB + 64 * KIB + 2 * 64 * KIB + 64 * KIB  # weights, input, both outputs, the gradient
    assert peak < 2 * 1024 * KIB
