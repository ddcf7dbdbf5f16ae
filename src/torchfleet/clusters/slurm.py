"""An sbatch script for a torchfleet job: one srun task per process.

    torchfleet slurm train.py --nodes 2 --gpus-per-node 4 --partition gpu --time 2:00:00

Each task is a plain `python train.py`: Fleet reads its rank from Slurm's own
variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, ...), and
torchfleet.env takes the master from the first host of the step's node list and the
port from the job id, so every task agrees without any extra launcher.

    torchfleet slurm train.py --nodes 4 --gpus-per-node 8 --fault-tolerance step --max-restarts 3

writes a job that survives a lost node instead (`ft_script`): torchft's
lighthouse in a step of its own on node 0, and on each node one replica group,
`torchfleet run --fault-tolerance step --lighthouse ...` (launcher/groups.py),
in a retry loop of its own, in an allocation that `--no-kill` keeps when a node
fails.

    torchfleet slurm train --requeue --time 4:00:00 -- --checkpoint-dir /shared/ck

runs `torchfleet train ... --resume auto` in every task (`train` in place of a
script), asks Slurm for SIGUSR1 120 s before the time limit, and requeues the job
once the tasks have saved on it and exited 75 (`requeue_lines`).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torchfleet.clusters import at_least, check_script, train_args
from torchfleet.config import FAULT_TOLERANCE
from torchfleet.errors import UsageError
from torchfleet.launcher.failures import PREEMPTED_EXIT
from torchfleet.launcher.preempt_relay import NOTE_VARIABLE as PREEMPT_NOTE

# Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds,
# days-hours, days-hours:minutes, days-hours:minutes:seconds (sbatch(1)).
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE")
_NAME = re.compile(r"[A-Za-z0-9_.,-]+")
# --requeue: the signal Slurm sends every task this long before the time limit (--signal), which
# torchfleet train takes as a preemption (worker/preemption.py): the tasks save and exit 75.
REQUEUE_SIGNAL = "USR1"
REQUEUE_SECONDS = 120


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
    fault_tolerance: str = "restart"  # or "step": one replica group per node under torchft (ft_script)
    max_restarts: int | None = None  # with "step": each group is started again at most this often (default 3)
    requeue: bool = False  # save on REQUEUE_SIGNAL, then requeue the job (requeue_lines)
    command: list[str] = field(init=False, default_factory=list)  # what every task runs

    def __post_init__(self) -> None:
        # `train`: the built-in job, `torchfleet train SCRIPT_ARGS` in every task (with --resume auto).
        train = train_args(self.script, self.script_args, self.requeue)
        if train is None:
            self.script = str(check_script(self.script))
            self.command = [self.python, "-u", self.script, *self.script_args]
        else:
            self.command = [self.python, "-u", "-m", "torchfleet", "train", *train]
        if train is not None and self.fault_tolerance == "step":
            raise UsageError(
                "`train` under --fault-tolerance step is not written by torchfleet slurm; give a"
                " script, or run `torchfleet train --fault-tolerance step` in your own batch script"
            )
        if self.requeue and self.fault_tolerance == "step":
            raise UsageError(
                "--requeue applies with --fault-tolerance restart (one srun step that saves and"
                " requeues the job); under step a failed group is started again instead"
            )
        self._check_fault_tolerance()
        at_least("--nodes", self.nodes, 1)
        at_least("--gpus-per-node", self.gpus_per_node, 0)
        if self.ntasks_per_node is None:
            self.ntasks_per_node = max(1, self.gpus_per_node)
        at_least("--ntasks-per-node", self.ntasks_per_node, 1)
        if self.gpus_per_node and self.ntasks_per_node > self.gpus_per_node:
            raise UsageError(
                f"--ntasks-per-node {self.ntasks_per_node} is more than "
                f"--gpus-per-node {self.gpus_per_node}; one task per GPU at most"
            )
        if self.time is not None and not _TIME.fullmatch(self.time):
            raise UsageError(
                f"--time {self.time!r} is not a Slurm time limit "
                f"(expected minutes, HH:MM:SS or D-HH:MM:SS, e.g. 2:00:00)"
            )
        if self.partition is not None and not _NAME.fullmatch(self.partition):
            raise UsageError(
                f"--partition {self.partition!r} is not a partition name (letters, digits, _ . - and commas)"
            )
        self.workdir = str(Path(self.workdir).resolve())

    def _check_fault_tolerance(self) -> None:
        if self.fault_tolerance not in FAULT_TOLERANCE:
            raise UsageError(
                f"--fault-tolerance {self.fault_tolerance!r} is not a mode; choose restart (one srun"
                " step of every process, which ends when one fails) or step (one replica group per"
                " node under torchft: the others go on when one is lost)"
            )
        if self.fault_tolerance == "restart":
            if self.max_restarts is not None:
                raise UsageError(
                    f"--max-restarts {self.max_restarts} applies with --fault-tolerance step"
                    " (which starts a failed node's group again)"
                )
            return
        if self.max_restarts is None:
            self.max_restarts = 3
        at_least("--max-restarts", self.max_restarts, 0)

    @property
    def world_size(self) -> int:
        assert self.ntasks_per_node is not None  # __post_init__ sets the default
        return self.nodes * self.ntasks_per_node

    @property
    def job_name(self) -> str:
        return "torchfleet-" + re.sub(r"[^A-Za-z0-9_.-]", "_", Path(self.script).stem)


def _directives(job: SlurmJob) -> list[str]:
    directives = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", f"--ntasks-per-node={job.ntasks_per_node}"]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.time:
        directives.append(f"--time={job.time}")
    directives += [f"--chdir={job.workdir}", "--output=%x-%j.out"]
    if job.requeue:
        # The signal goes to every task (not the batch shell: no B:), --requeue lets the job be
        # requeued, and the requeued run appends to the same log instead of truncating it.
        directives += [f"--signal={REQUEUE_SIGNAL}@{REQUEUE_SECONDS}", "--requeue", "--open-mode=append"]
    if job.fault_tolerance == "step":
        directives.append("--no-kill")  # a failed node leaves the allocation, not the job
    return ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), ""]


def batch_script(job: SlurmJob) -> str:
    """The sbatch script for `job`, ready for `sbatch FILE`."""
    if job.fault_tolerance == "step":
        return ft_script(job)
    command = shlex.join(job.command)
    lines = [
        *_directives(job),
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
    if not job.requeue:
        lines += [f"srun --kill-on-bad-exit=1 {command}", ""]
        return "\n".join(lines)
    return "\n".join([*lines, *requeue_lines(command), ""])


def requeue_lines(command: str) -> list[str]:
    """The srun step under --requeue, and the requeue after a save on the signal."""
    return [
        "",
        f"# --requeue: SIG{REQUEUE_SIGNAL} reaches every task {REQUEUE_SECONDS} s before the time limit (and",
        f"# `scancel --signal={REQUEUE_SIGNAL} JOBID` sends it at any time); SIGTERM (preemption, scancel) too.",
        "# torchfleet train then finishes the step, saves one checkpoint and exits 75; local rank 0 writes",
        "# where to the note below. This script then requeues the job, which runs again from the top:",
        "# the same command, and --resume auto continues from that checkpoint.",
        'note="${TMPDIR:-/tmp}/torchfleet-preempt-$SLURM_JOB_ID"',
        'rm -f "$note"',
        f'export {PREEMPT_NOTE}="$note"',
        'echo "torchfleet: job $SLURM_JOB_ID starts (requeued ${SLURM_RESTART_COUNT:-0} time(s) so far)"',
        "status=0",
        f"srun --kill-on-bad-exit=1 {command} || status=$?",
        "# One task's 75 ends the step (--kill-on-bad-exit), so srun may report another's status: the note",
        "# says that the checkpoint was saved.",
        f'if [ "$status" -eq {PREEMPTED_EXIT} ] || [ -s "$note" ]; then',
        '    echo "torchfleet: $(cat "$note" 2>/dev/null || echo "preempted, checkpointed (exit 75)");'
        ' requeueing job $SLURM_JOB_ID"',
        '    rm -f "$note"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        f"    exit {PREEMPTED_EXIT}",
        "fi",
        'rm -f "$note"',
        'exit "$status"',
    ]


def ft_script(job: SlurmJob) -> str:
    """The sbatch script for `--fault-tolerance step`: a lighthouse on node 0, one replica group per
    node, each started again on failure, at most `max_restarts` times; the job waits for every group."""
    n, m = job.nodes, job.max_restarts
    lines = [
        *_directives(job),
        f"# Written by `torchfleet slurm --fault-tolerance step`: {n} replica group(s) of"
        f" {job.ntasks_per_node} process(es),",
        "# one per node, each `torchfleet run --fault-tolerance step` under torchft. When a group fails, the",
        f"# others go on at their next step; its loop below starts it again (at most {m} times, the same",
        "# command) and it heals from a live peer. --no-kill keeps the allocation when a node fails: that",
        "# node's group is not replaced, and the others train on without it. The lighthouse, where the",
        "# groups meet, runs on node 0: the job needs node 0 to live.",
        "set -uo pipefail  # no -e: a group that fails is started again below, not the end of the job",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "# The lighthouse listens on the address it is given only, so give it node 0's address (its",
        "# NodeAddr), not its name, which may resolve to 127.0.0.1 on the node itself.",
        "head=$(scontrol show node \"${nodes[0]}\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        "head=${head:-${nodes[0]}}",
        "# The lighthouse's port, as torchfleet takes the master's under Slurm: every group computes the",
        "# same one without talking, consecutive jobs sharing node 0 get different ones, and 15000-24999",
        "# lies below Linux's ephemeral range (32768-60999), where the kernel hands out outgoing ports.",
        "port=$((15000 + SLURM_JOB_ID % 10000))",
        'endpoint="$head:$port"',
        '[[ $head == *:* ]] && endpoint="[$head]:$port"  # an IPv6 address',
    ]
    if job.world_size > job.nodes:  # as batch_script: one intra-op thread per process unless chosen
        lines.append('export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"')
    lines += [
        "",
        "# The lighthouse in a step of its own, not in node 0's group: a group that fails and starts",
        "# again finds it still there, with the others' membership, and its port still bound (a new one",
        "# could not bind it while the old one's connections linger in TIME_WAIT). --overlap: it shares",
        "# node 0's CPUs with the group there (Slurm 20.11 or later); --quiet: srun's notes when it is stopped.",
        f'srun --overlap --quiet --nodes=1 --ntasks=1 --nodelist="${{nodes[0]}}" {shlex.quote(job.python)}'
        ' -m torchfleet lighthouse --host "$head" --port "$port" &',
        "lighthouse=$!",
        "",
        f"group() {{  # group I COMMAND...: node I's replica group, started again at most {m} times",
        "    local attempt=0 status",
        '    until "${@:2}"; do',
        "        status=$?",
        f'        if [ "$attempt" -ge {m} ]; then',
        f'            echo "group $1 ended with status $status; it was started again {m} time(s), no more" >&2',
        '            return "$status"',
        "        fi",
        "        attempt=$((attempt + 1))",
        f'        echo "group $1 ended with status $status; starting it again (attempt $attempt of {m})" >&2',
        "        sleep 5  # time for Slurm to mark a node that is going down, and for the others to go on",
        "    done",
        "}",
        "",
        "# --kill-on-bad-exit: a group's failed task ends its step at once, so its loop can start it again.",
        "# --master-addr only picks the interface, the one that reaches the lighthouse.",
        "pids=()",
    ]
    for i in range(n):
        command = [
            job.python,
            "-m",
            "torchfleet",
            "run",
            "--fault-tolerance",
            "step",
            "--nnodes",
            str(n),
            "--node-rank",
            str(i),
        ]
        rest = ["-n", str(job.ntasks_per_node), job.script, *job.script_args]
        lines += [
            f'group {i} srun --nodes=1 --ntasks=1 --nodelist="${{nodes[{i}]}}" --kill-on-bad-exit=1 '
            f'{shlex.join(command)} --master-addr "$head" --lighthouse "$endpoint" {shlex.join(rest)} &',
            "pids+=($!)",
        ]
    lines += [
        "failed=0",
        'for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done',
        'echo "torchfleet: every replica group has ended; stopping the lighthouse (Slurm says its step was cancelled)"',
        'kill "$lighthouse" 2>/dev/null; wait "$lighthouse"',
        f'if [ "$failed" -gt 0 ]; then echo "$failed of {n} replica group(s) never finished" >&2; exit 1; fi',
        "",
    ]
    return "\n".join(lines)


def submit(path: str | Path) -> tuple[int, str]:
    """`sbatch path`: (exit status, what sbatch printed). UsageError if sbatch is missing."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UsageError(
            "sbatch is not on PATH; run --submit on a Slurm login node, "
            f"or copy {str(path)!r} there and run `sbatch {Path(path).name}`"
        )
    out = subprocess.run([sbatch, str(path)], capture_output=True, text=True, timeout=120)
    return out.returncode, (out.stdout + out.stderr).strip()
