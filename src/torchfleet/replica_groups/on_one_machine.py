"""diloco and localsgd on one machine: `torchfleet train --strategy diloco -n N` runs N replica groups.

Across machines each machine is a replica group, as under --fault-tolerance
step. On one machine there is one machine and several processes, so each
process is a group of its own: this command starts N launchers, as if the
machine were N machines (`--nnodes N --node-rank g` on loopback, one process
each); the first starts torchft's lighthouse. What the user reads comes from
the first group, as torchrun shows rank 0's; the others' output is kept and
shown only when one of them fails, and they write none of the output files
(the groups end with the same weights, so the first's files say it all).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

from torchfleet.config import LaunchConfig
from torchfleet.netif import free_port

# The first group's files are the job's: the others would write the same paths with the same contents.
_OUTPUT_FLAGS = ("--json-out", "--metrics-out", "--tensorboard", "--save-model")
_TAIL = 40  # lines of a failed group's output shown


def without_outputs(argv: list[str]) -> list[str]:
    """`argv` with the output-file flags and their values taken out."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _OUTPUT_FLAGS:
            skip = True
            continue
        if arg.startswith(tuple(f"{flag}=" for flag in _OUTPUT_FLAGS)):
            continue
        kept.append(arg)
    return kept


def run_groups_here(launch: LaunchConfig, argv: list[str], strategy: str) -> int:
    """One replica group per process on this machine; the exit status is the first failing group's."""
    groups = launch.nproc_per_node
    port = launch.master_port or free_port()
    procs: list[tuple[subprocess.Popen, Path | None]] = []
    with tempfile.TemporaryDirectory(prefix="torchfleet-groups-") as folder:
        try:
            for group in range(groups):
                args = argv if group == 0 else [*without_outputs(argv), "--no-progress"]
                cmd = [
                    sys.executable,
                    "-m",
                    "torchfleet",
                    "train",
                    *args,
                    "--strategy",
                    strategy,
                    "--nnodes",
                    str(groups),
                    "--node-rank",
                    str(group),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(port),
                    "--nproc-per-node",
                    "1",
                    "--fault-tolerance",
                    "step",
                    "--max-restarts",
                    str(launch.max_restarts),
                ]
                if group == 0:
                    procs.append((subprocess.Popen(cmd), None))
                    continue
                log = Path(folder) / f"group{group}.log"
                with log.open("w") as out:
                    procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), log))
            codes = [proc.wait() for proc, _ in procs]
        except BaseException:  # Ctrl-C or a signal: the groups go too
            for proc, _ in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            for proc, _ in procs:
                proc.wait()
            raise
        for (proc, log), code in zip(procs, codes, strict=True):
            if code and log is not None:
                lines = log.read_text(errors="replace").splitlines()[-_TAIL:]
                print(
                    f"torchfleet: replica group {procs.index((proc, log))} exited with status {code}; its"
                    " last lines:\n" + "\n".join(f"  {line}" for line in lines),
                    file=sys.stderr,
                    flush=True,
                )
    return next((code for code in codes if code), 0)
