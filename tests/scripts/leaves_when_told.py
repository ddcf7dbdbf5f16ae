"""A user's script that leaves when told to: asks fleet.preempted() after each step, saves, fleet.leave().

    torchfleet run -n 2 leaves_when_told.py CK OUT STEPS [MARKER]

Resumes from the newest checkpoint in CK when there is one. With MARKER, rank 0 creates it in step 5
and sleeps a second there, so a test's signal lands in that step on every run.
"""

import sys
import time
from pathlib import Path

import torch
from torch import nn

import torchfleet
from torchfleet.checkpoint import list_checkpoints

ck, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
marker = Path(sys.argv[4]) if len(sys.argv) > 4 else None

fleet = torchfleet.Fleet(strategy="ddp")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fleet.setup(model, optimizer)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
loader = fleet.dataloader(data, batch_size=32, seed=0)
sampler = loader.batch_sampler

step = 0
found = list_checkpoints(ck) if ck.is_dir() else []
if found:
    extra = fleet.load(found[-1])
    step = extra["step"]
    sampler.load_state_dict(extra["sampler"])
    fleet.print(f"resumed at step {step}")
while step < steps:
    for inputs, targets in loader:
        fleet.train_step(inputs, targets, nn.functional.mse_loss)
        step += 1
        if step == 5 and marker is not None and fleet.rank == 0 and fleet.env.restart_count == 0:
            marker.touch()
            time.sleep(1)
        if fleet.preempted():
            path = ck / f"step-{step:08d}"
            fleet.save(path, step=step, sampler=sampler.state_dict())
            fleet.leave(path, step)
        if step == steps:
            break
fleet.save_model(out)
fleet.print(f"attempt {fleet.env.restart_count} finished at step {step}")
fleet.close()
