"""glibc's malloc keeps a training step's memory for the next step, instead of page-faulting it in again."""

import json
import platform
import subprocess
import sys

import pytest

from conftest import clean_env

# Page faults are counted, not timed: they do not depend on how busy the machine is.
FAULTS_PER_STEP = """
import json, resource, torch
from torch import nn
from torchfleet import Fleet, allocator
from torchfleet.train.models import build_model
torch.set_num_threads(1)
fleet = Fleet(strategy="serial")
net = build_model("cnn", (1, 8, 8), 10)
fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
x, y = torch.randn(256, 1, 8, 8), torch.randint(0, 10, (256,))
for _ in range(10):
    fleet.train_step(x, y, nn.CrossEntropyLoss())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    fleet.train_step(x, y, nn.CrossEntropyLoss())
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50
print(json.dumps({"faults_per_step": faults, "raised": allocator.keep_freed_memory()}))
"""


def _faults(choice: str | None) -> dict:
    env = clean_env()
    if choice is not None:
        env["TORCHFLEET_MALLOC"] = choice
    done = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_cpu_fleet_keeps_freed_memory_and_stops_refaulting_it():
    tuned, default = _faults(None), _faults("default")
    assert tuned["raised"] and not default["raised"]
    # The CNN at 256 samples frees and re-requests about 7 MiB a step; glibc's own
    # thresholds hand it back to the kernel (about 1,900 faults a step here). Tuned, the count
    # still moves with the machine: 0.02 to 61 a step were seen on one machine within minutes,
    # in steps of 1 MiB of pages (the kernel's proactive reclaim, kdamond, takes idle pages back),
    # so the bound is 200: a tenth of glibc's own, where the tuning works at all.
    assert tuned["faults_per_step"] < 200, tuned
    assert default["faults_per_step"] > 10 * max(tuned["faults_per_step"], 1), (tuned, default)

