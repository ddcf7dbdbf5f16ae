"""The launcher's side of preemption: the signals it hands on, what it tells the workers, its exit.

Under torchfleet's launcher the agent (torchrun's) gets the signal first: it
sends the same signal to every worker, waits 30 s for them (torch's shutdown
timeout; TORCH_ELASTIC_SHUTDOWN_TIMEOUT on torch versions that read it), then
SIGKILLs them and raises SignalException, which says nothing of what the
workers did. So the launcher names a file in NOTE_VARIABLE, each machine's
local rank 0 writes the preemption sentence there once the checkpoint is
saved (worker/preemption.py, the workers' side), and the launcher reads it
back (`report`). The variables and `parse_signals` are shared by both sides.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from torchfleet.errors import UsageError
from torchfleet.launcher.environ import exported
from torchfleet.launcher.failures import PREEMPTED_EXIT

NOTE_VARIABLE = "TORCHFLEET_PREEMPT_NOTE"
# `torchfleet run --preempt-signals/--preempt-notice` reach the script's Fleet through these.
SIGNALS_VARIABLE = "TORCHFLEET_PREEMPT_SIGNALS"
NOTICE_VARIABLE = "TORCHFLEET_PREEMPT_NOTICE"
DEFAULT_SIGNALS = "TERM,USR1"
# torchrun's agent handles these by default (torch.distributed.launcher.api's signals_to_handle); any other it
# would leave to the default action, which for SIGUSR1 kills the agent and orphans the workers.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """ "TERM,USR1" (or "SIGTERM,sigusr1", or "none") -> the signals; UsageError naming a bad one."""
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    if names == ["NONE"]:
        return ()
    found = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in _UNCATCHABLE:
            why = "cannot be caught" if sig is not None else "is not a signal name"
            raise UsageError(f"--preempt-signals {text!r}: {name} {why}; give names such as TERM,USR1 (or none)")
        found.append(sig)
    if not found:
        raise UsageError(f"--preempt-signals {text!r} names no signal; give names such as TERM,USR1 (or none)")
    return tuple(dict.fromkeys(found))


def agent_signals(text: str) -> str:
    """torchrun's signals_to_handle: its own, and the preemption signals, so that the agent passes
    each on to the workers instead of dying of it."""
    names = [*AGENT_SIGNALS, *(s.name for s in parse_signals(text) if s.name not in AGENT_SIGNALS)]
    return ",".join(names)


@contextlib.contextmanager
def noting(signals: str, notice: str) -> Iterator[Path]:
    """For the launcher while its workers run: the file their local rank 0 writes the preemption
    sentence to (NOTE_VARIABLE), and the signals and notice source a script's Fleet listens for, all
    in the environment the workers inherit; put back after."""
    with tempfile.TemporaryDirectory(prefix="torchfleet-preempt-") as folder:
        note = Path(folder) / "note"
        with exported({NOTE_VARIABLE: str(note), SIGNALS_VARIABLE: signals, NOTICE_VARIABLE: notice}):
            yield note


def report(note: Path, sigval: signal.Signals, why: str) -> int:
    """The launcher's exit after its agent was stopped by `sigval`: PREEMPTED_EXIT when the workers
    saved (their note says where), else the shell's 128 + signal number, `why` saying what may have
    kept them from saving."""
    if note.is_file() and note.read_text().strip():
        print(f"torchfleet: {note.read_text().strip()}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    print(
        f"torchfleet: error: stopped by {sigval.name} before a checkpoint was saved ({why})",
        file=sys.stderr,
        flush=True,
    )
    return 128 + int(sigval)


# What report says kept the workers from saving, for the built-in job and for a script.
TRAIN_WHY = "without --checkpoint-dir, or before the first step, or the save outlasted the agent's 30 s"
SCRIPT_WHY = (
    "the script does not ask fleet.preempted() and leave with fleet.leave(), or it was told before"
    " its first call, or the save outlasted the agent's 30 s"
)
