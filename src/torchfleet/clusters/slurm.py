"""An sbatch script for a torchfleet job: one srun task per process.

    torchfleet slurm train.py --nodes 2 --gpus-per-node 4 --partition gpu --time 2:00:00

Each task is a plain `python train.py`: Fleet reads its rank from Slurm's own
variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, ...), and
torchfleet.env takes the master from the first host of the step's node list and the
port from the job id, so every task agrees without any extra launcher.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torchfleet.clusters import at_least, check_script
from torchfleet.errors import UsageError

# Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds,
# days-hours, days-hours:minutes, days-hours:minutes:seconds (sbatch(1)).
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE")
_NAME = re.compile(r"[A-Za-z0-9_.,-]+")


@dataclass
class SlurmJob:
    script: str
    script_args: list[str] = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 0
    ntasks_per_node: int | None = None  # default: one per GPU, or one per node without GPUs
    partition: str | None = None
    time: str | None = None
    python: str = sys.executable  # the interpreter that wrote the job; compute nodes must have it
    workdir: str = "."

    def __post_init__(self) -> None:
        self.script = str(check_script(self.script))
        at_least("--nodes", self.nodes, 1)
        at_least("--gpus-per-node", self.gpus_per_node, 0)
        if self.ntasks_per_node is None:
            self.ntasks_per_node = max(1, self.gpus_per_node)
        at_least("--ntasks-per-node", self.ntasks_per_node, 1)
        if self.gpus_per_node and self.ntasks_per_node > self.gpus_per_node:
            raise UsageError(f"--ntasks-per-node {self.ntasks_per_node} is more than "
                             f"--gpus-per-node {self.gpus_per_node}; one task per GPU at most")
        if self.time is not None and not _TIME.fullmatch(self.time):
            raise UsageError(f"--time {self.time!r} is not a Slurm time limit "
                             f"(expected minutes, HH:MM:SS or D-HH:MM:SS, e.g. 2:00:00)")
        if self.partition is not None and not _NAME.fullmatch(self.partition):
            raise UsageError(f"--partition {self.partition!r} is not a partition name "
                             f"(letters, digits, _ . - and commas)")
        self.workdir = str(Path(self.workdir).resolve())

    @property
    def world_size(self) -> int:
        assert self.ntasks_per_node is not None  # __post_init__ sets the default
        return self.nodes * self.ntasks_per_node

    @property
    def job_name(self) -> str:
        return "torchfleet-" + re.sub(r"[^A-Za-z0-9_.-]", "_", Path(self.script).stem)


def batch_script(job: SlurmJob) -> str:
    """The sbatch script for `job`, ready for `sbatch FILE`."""
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.ntasks_per_node}",
    ]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.time:
        directives.append(f"--time={job.time}")
    directives += [f"--chdir={job.workdir}", "--output=%x-%j.out"]
    command = shlex.join([job.python, "-u", job.script, *job.script_args])
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "",
        f"# Written by `torchfleet slurm`: {job.world_size} processes "
        f"({job.nodes} node(s) x {job.ntasks_per_node}), one srun task each.",
        "# Every task reads its rank from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; torchfleet",
        "# takes the master from the first host of SLURM_JOB_NODELIST and the port",
        "# 15000 + SLURM_JOB_ID % 10000. Export MASTER_ADDR / MASTER_PORT here to override.",
        "set -euo pipefail",
    ]
    if job.world_size > job.nodes:  # more than one task per node
        # As torchrun does: tasks sharing a node get one intra-op thread each
        # unless the user chose, or they fight over the same cores.
        lines.append('export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"')
    # --kill-on-bad-exit: one failed task ends the step instead of leaving
    # its peers waiting in a collective until the time limit.
    lines += [f"srun --kill-on-bad-exit=1 {command}", ""]
    return "\n".join(lines)


def submit(path: str | Path) -> tuple[int, str]:
    """`sbatch path`: (exit status, what sbatch printed). UsageError if sbatch is missing."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UsageError("sbatch is not on PATH; run --submit on a Slurm login node, "
                         f"or copy {str(path)!r} there and run `sbatch {Path(path).name}`")
    out = subprocess.run([sbatch, str(path)], capture_output=True, text=True, timeout=120)
    return out.returncode, (out.stdout + out.stderr).strip()
