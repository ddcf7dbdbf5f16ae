"""bench's link mode: one cell on one machine, as `torchfleet run` starts it on every machine (cell_process.py).

    python -m torchfleet.bench.link.measure_on_machine SPEC_JSON RESULT_PATH

One process per machine: the cell's `Fleet` (ddp, ddp with PowerSGD, or diloco/localsgd as a replica group
of one), bench's model and one in-memory batch of this machine's share of the global batch (bench/measure_cell.py's
`workload`: gpt's is random tokens), AdamW. It writes RESULT_PATH as JSON: what node 0 combines (report.py).

What is timed, and why so:
- blocks: after `warmup` steps, `steps` timed steps in blocks of `sync_every`; a block's time is the sum of
  its steps' times (each `train_step`, bracketed by device synchronisation on CUDA). diloco meets once per
  block, at its last step, so a block's mean step carries that meeting's share: diloco's median *step*
  would be one between meetings and flatter it. ddp's and PowerSGD's blocks are timed alike, so every
  cell's figure is the same statistic.
- compute: after each block, the same step on a private copy of the model and optimizer, in no process
  group, so it never communicates; the cell's communication share is 1 - compute / step (report.py).
  Timed in the cell's own processes rather than in a separate run: on a shared machine another moment's
  load moves a step by more than the share. PowerSGD's own arithmetic (its products and orthogonalisation)
  counts as communication: it is what compressing costs.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

from torchfleet.bench.measure_cell import workload
from torchfleet.fleet import Fleet
from torchfleet.models import TOKEN_MODELS, gpt_config

LR = 1e-3  # AdamW: the DiLoCo paper's inner optimizer; the figures are speed, not learning


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _autocast(device: torch.device, precision: str):
    """The probe's precision, as the cell's (Fleet autocasts its own step)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def measure(spec: dict) -> dict:
    """This machine's blocks and probes; `spec` is bench/measure_cell.py's workload spec plus fleet, precision,
    threads, nnodes, node_rank, global_batch, warmup, steps and sync_every."""
    torch.set_num_threads(spec["threads"])
    fleet = Fleet(precision=spec["precision"], **spec["fleet"])
    # One process per machine: a machine's share is the global batch over the machines, whichever way the
    # strategy groups them (diloco's groups of one see a world of one).
    local_batch = spec["global_batch"] // spec["nnodes"]
    model, inputs, targets, loss_fn = workload(spec, local_batch, spec["node_rank"], fleet)
    probe = copy.deepcopy(model).to(fleet.device)  # before setup wraps, shards or moves the model
    probe_optimizer = torch.optim.AdamW(probe.parameters(), lr=LR)
    fleet.setup(model, torch.optim.AdamW(model.parameters(), lr=LR), example_inputs=inputs)

    def step():
        fleet.train_step(inputs, targets, loss_fn)

    def compute_only():
        probe_optimizer.zero_grad(set_to_none=True)
        with _autocast(fleet.device, spec["precision"]):
            loss = loss_fn(probe(inputs), targets)
        loss.backward()
        probe_optimizer.step()

    for _ in range(spec["warmup"]):
        step()
    compute_only()  # AdamW makes its state on its first step: not a step's cost
    every = spec["sync_every"]
    blocks, probes = [], []
    for _ in range(spec["steps"] // every):
        blocks.append(sum(_timed(step, fleet.device) for _ in range(every)))
        probes.append(_timed(compute_only, fleet.device))
    fleet.finish()  # diloco's last meeting: none, as the timed steps end on one
    result = {
        "node": spec["node_rank"],
        "block_s": blocks,
        "probe_s": probes,
        "local_batch": local_batch,
        "tokens_per_sample": gpt_config(spec["gpt_preset"]).block_size if spec["model"] in TOKEN_MODELS else None,
        "threads_per_process": torch.get_num_threads(),
        "device": str(fleet.device),
        "backend": fleet.backend,
        "notes": list(fleet.notes),
        # The last minute's load against the cores: other work on the machine slows a cell as a slow link does.
        "load_avg": os.getloadavg()[0],
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
    }
    fleet.close()
    return result


def main(argv: list[str]) -> None:
    spec, out = json.loads(argv[0]), Path(argv[1])
    out.write_text(json.dumps(measure(spec)))


if __name__ == "__main__":
    main(sys.argv[1:])
