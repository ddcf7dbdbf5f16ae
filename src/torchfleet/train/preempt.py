"""Leaving cleanly when the cluster takes the machines back: SIGTERM, SIGUSR1, a spot notice.

Kubernetes sends SIGTERM and kills 30 s later (terminationGracePeriodSeconds);
Slurm sends SIGTERM on preemption or scancel and SIGKILL after KillWait (30 s
by default), or a chosen signal ahead of the time limit (--signal=USR1@120);
a spot reclaim reaches the processes as SIGTERM (SageMaker, Kubernetes'
node-termination handlers). The handler only sets a flag; the training loop
(loop.py) finishes the step in flight, the ranks agree, one verified
checkpoint is written, and the job exits with PREEMPTED_EXIT.

Under torchfleet's launcher the agent (torchrun's) gets the signal first: it
sends the same signal to every worker, waits 30 s for them (torch's shutdown
timeout; TORCH_ELASTIC_SHUTDOWN_TIMEOUT on torch versions that read it), then
SIGKILLs them and raises SignalException, which says nothing of what the
workers did. So the launcher names a file in NOTE_VARIABLE, each machine's
local rank 0 writes the preemption sentence there once the checkpoint is
saved, and the launcher reads it back (`report`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from torchfleet.errors import UsageError
from torchfleet.launcher.failures import PREEMPTED_EXIT, record_preempted

NOTE_VARIABLE = "TORCHFLEET_PREEMPT_NOTE"
DEFAULT_SIGNALS = "TERM,USR1"
# torchrun's agent handles these by default (launcher/api.py's signals_to_handle); any other it
# would leave to the default action, which for SIGUSR1 kills the agent and orphans the workers.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """"TERM,USR1" (or "SIGTERM,sigusr1", or "none") -> the signals; UsageError naming a bad one."""
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    if names == ["NONE"]:
        return ()
    found = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in _UNCATCHABLE:
            why = "cannot be caught" if sig is not None else "is not a signal name"
            raise UsageError(f"--preempt-signals {text!r}: {name} {why}; give names such as TERM,USR1"
                             " (or none)")
        found.append(sig)
    if not found:
        raise UsageError(f"--preempt-signals {text!r} names no signal; give names such as TERM,USR1 (or none)")
    return tuple(dict.fromkeys(found))


class Listener:
    """Handlers for the preemption signals while training; `requested` is this process's flag."""

    def __init__(self, signals: tuple[signal.Signals, ...]):
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}  # whatever signal.signal returned

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame) -> None:
        # Only a flag: the loop acts between steps, where every rank can agree and save. A
        # second signal (Slurm and the agent may both send one) changes nothing.
        if self.received is None:
            self.received = signal.Signals(signum)

    def __enter__(self) -> Listener:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            # None: the previous handler was not set from Python; the default is the nearest to it.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def listening(text: str | None) -> Listener:
    """A Listener for `text`'s signals; none outside the main thread, where Python allows no handler."""
    if not text or threading.current_thread() is not threading.main_thread():
        return Listener(())
    return Listener(parse_signals(text))


class Preempted(SystemExit):
    """Raised by the loop once the checkpoint is saved; a SystemExit so that the worker's wrapper
    (failures.call_recorded) and the command line exit with its code instead of reporting a crash."""

    def __init__(self, message: str):
        super().__init__(PREEMPTED_EXIT)
        self.message = message


def leave(fleet, listener: Listener, step: int, path: Path) -> Preempted:
    """Say that the job was preempted and where its checkpoint is; returns the exception to raise."""
    how = f" by {listener.received.name}" if listener.received else ""  # a rank told by its peers has none
    message = f"preempted{how} at step {step}, checkpoint saved to {path}, resume with --resume"
    note = os.environ.get(NOTE_VARIABLE)
    if note and fleet.env.local_rank == 0:
        Path(note).write_text(message + "\n")  # torchfleet's launcher prints it (report)
    elif not note and fleet.is_main:
        print(f"torchfleet: {message}", file=sys.stderr, flush=True)
    # Read by the launcher's summary when the workers alone got the signal and exited with the code.
    record_preempted(message)
    return Preempted(message)


def agent_signals(text: str) -> str:
    """torchrun's signals_to_handle: its own, and the preemption signals, so that the agent passes
    each on to the workers instead of dying of it."""
    names = [*AGENT_SIGNALS, *(s.name for s in parse_signals(text) if s.name not in AGENT_SIGNALS)]
    return ",".join(names)


def report(note: Path, sigval: signal.Signals) -> int:
    """The launcher's exit after its agent was stopped by `sigval`: PREEMPTED_EXIT when the workers
    saved (their note says where), else the shell's 128 + signal number."""
    if note.is_file() and note.read_text().strip():
        print(f"torchfleet: {note.read_text().strip()}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    print(f"torchfleet: error: stopped by {sigval.name} before a checkpoint was saved (without"
          " --checkpoint-dir, or before the first step, or the save outlasted the agent's 30 s)",
          file=sys.stderr, flush=True)
    return 128 + int(sigval)
