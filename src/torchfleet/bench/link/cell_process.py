"""bench's link mode: one cell's `torchfleet run` on this machine, with a deadline and a log.

Every machine starts the same command at once (meeting.py brings them together first):

    python -m torchfleet run --nnodes N --node-rank R --master-addr A --master-port P+1+i -n 1 --no-preflight
        [--fault-tolerance step] -m torchfleet.bench.link.measure_on_machine SPEC RESULT

so a cell goes through the real launcher: torchrun's static rendezvous for ddp and PowerSGD, one replica
group per machine under torchft for diloco and localsgd (node 0's launcher starts the lighthouse). The
bench's own preflight has already checked the machines, hence --no-preflight, which also makes node 1
wait up to a minute for node 0's port to answer: the preflight knocks for only 4 s, and a loaded node 0
may take longer than that to start its launcher. The output goes to a log file; a cell that fails is
one row with the reason from it, and the rest of the bench still runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from torchfleet.bench.link.job import MEETING_CELLS, LinkJob, Machines

_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception)\b.*: ")
STOP_SECONDS = 15.0  # after SIGTERM, how long the launcher gets to stop its workers itself


def command(cell: str, index: int, plan: LinkJob, machines: Machines, spec: dict, result: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchfleet",
        "run",
        "--nnodes",
        str(machines.nnodes),
        "--node-rank",
        str(machines.node_rank),
        "--master-addr",
        machines.master_addr,
        "--master-port",
        str(machines.cell_port(index)),
        "-n",
        "1",
        "--no-preflight",
        *(["--fault-tolerance", "step"] if cell in MEETING_CELLS else []),
        "-m",
        "torchfleet.bench.link.measure_on_machine",
        json.dumps(spec),
        str(result),
    ]


def spec_of(cell: str, plan: LinkJob, machines: Machines, threads: int) -> dict:
    """What measure_on_machine.py's worker measures (bench/measure_cell.py's workload fields, and the cell's own)."""
    return {
        "model": plan.model,
        "gpt_preset": plan.gpt_preset,
        "image_size": plan.image_size,
        "seed": plan.seed,
        "fleet": plan.fleet_options(cell),
        "precision": plan.precision,
        "threads": threads,
        "nnodes": machines.nnodes,
        "node_rank": machines.node_rank,
        "global_batch": plan.global_batch,
        "warmup": plan.warmup,
        "steps": plan.steps,
        "sync_every": plan.sync_every,
    }


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`: torchrun's agent starts each worker in a session of its own, so
    signalling the agent's process group would miss them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher, which stops its workers and node 0's lighthouse; SIGKILL whatever is left."""
    below = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def failure_reason(log: str, code: int | None) -> str:
    """One line saying why the cell failed on this machine, from its log."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line.removeprefix("torchfleet: error: ") for line in lines if line.startswith("torchfleet: error: ")]
    raised = [line for line in lines if _EXCEPTION.match(line)]
    if errors and not (errors[-1].startswith("rank ") and raised):
        text = errors[-1]
    elif raised:
        text = raised[-1]  # a crash's summary names the rank; its exception says why
    elif lines:
        text = lines[-1]
    else:
        text = f"exit status {code} without a word"
    return text if len(text) <= 300 else text[:297] + "..."


def run_here(cell: str, index: int, plan: LinkJob, machines: Machines, threads: int, log: Path) -> dict:
    """This machine's part of `cell`: {"status": "ok", "result": worker's figures, "wall_s"} or
    {"status": "failed", "error": one line, "wall_s"}. Never raises for the cell's own failure."""
    result = log.with_suffix(".json")
    result.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            command(cell, index, plan, machines, spec_of(cell, plan, machines, threads), result),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=plan.cell_timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = None
        except BaseException:  # Ctrl-C: the cell's processes go too
            stop(proc)
            raise
    wall = time.perf_counter() - start
    if code == 0 and result.exists():
        return {"status": "ok", "result": json.loads(result.read_text()), "wall_s": wall}
    if code is None:
        return {"status": "failed", "error": f"timed out after {plan.cell_timeout_s:.0f} s", "wall_s": wall}
    return {"status": "failed", "error": failure_reason(log.read_text(errors="replace"), code), "wall_s": wall}
