"""Leaving cleanly when the cluster takes the machines back: SIGTERM, SIGUSR1, a spot notice.

Kubernetes sends SIGTERM and kills 30 s later (terminationGracePeriodSeconds);
Slurm sends SIGTERM on preemption or scancel and SIGKILL after KillWait (30 s
by default), or a chosen signal ahead of the time limit (--signal=USR1@120);
a spot reclaim reaches the processes as SIGTERM (SageMaker, Kubernetes'
node-termination handlers) or only as a notice in the instance's metadata
(spot_notices.py watches it). The handler only sets a flag; the training loop
(train/loop.py), or a script through Fleet.preempted(), finishes the step in
flight, the ranks agree, one verified checkpoint is written, and the job exits
with PREEMPTED_EXIT.

This is the workers' side. Under torchfleet's launcher each machine's local
rank 0 writes the preemption sentence to the file named in NOTE_VARIABLE once
the checkpoint is saved, and the launcher reads it back
(launcher/preempt_relay.py, which also holds the variables and signal names
both sides share).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from torchfleet.launcher.failures import PREEMPTED_EXIT, record_preempted
from torchfleet.launcher.preempt_relay import (
    DEFAULT_SIGNALS,
    NOTE_VARIABLE,
    NOTICE_VARIABLE,
    SIGNALS_VARIABLE,
    parse_signals,
)
from torchfleet.worker import spot_notices


class Listener:
    """Handlers for the preemption signals (and a spot-notice watcher) while training; `requested` is
    this process's flag and `reason` what set it ("SIGTERM", "a spot notice ...")."""

    def __init__(self, signals: tuple[signal.Signals, ...], notice: str | None = None):
        self.signals = signals
        self.notice = notice  # spot_notices.py's spec ("aws", a URL); None: no watcher
        self.reason: str | None = None
        self._previous: dict[signal.Signals, Any] = {}  # whatever signal.signal returned
        self._watcher: spot_notices.Watcher | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def told(self, reason: str) -> None:
        # Only a flag: the loop acts between steps, where every rank can agree and save. A
        # second signal (Slurm and the agent may both send one), or a notice after it, changes nothing.
        if self.reason is None:
            self.reason = reason

    def _handle(self, signum: int, frame) -> None:
        self.told(signal.Signals(signum).name)

    def __enter__(self) -> Listener:
        if self.notice:  # checked first: an unreachable metadata service is refused before anything changes
            self._watcher = spot_notices.Watcher(self.notice, self.told).start()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        for sig, handler in self._previous.items():
            # None: the previous handler was not set from Python; the default is the nearest to it.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()


def listening(text: str | None, notice: str | None = None, watch: bool = True) -> Listener:
    """A Listener for `text`'s signals and, where `watch` (one process per machine polls), `notice`'s
    spot notices; no signal handler outside the main thread, where Python allows none."""
    notice = notice if watch and notice and notice != "none" else None
    if not text or threading.current_thread() is not threading.main_thread():
        return Listener((), notice)
    return Listener(parse_signals(text), notice)


class Preempted(SystemExit):
    """Raised by the loop once the checkpoint is saved; a SystemExit so that the worker's wrapper
    (failures.call_recorded) and the command line exit with its code instead of reporting a crash."""

    def __init__(self, message: str):
        super().__init__(PREEMPTED_EXIT)
        self.message = message


def leave(
    listener: Listener,
    local_rank: int,
    is_main: bool,
    step: int | None,
    path: Path | str | None,
    hint: str = ", resume with --resume",
) -> Preempted:
    """Say that the job was preempted and where its checkpoint is; returns the exception to raise."""
    how = f" by {listener.reason}" if listener.reason else ""  # a rank told by its peers has none
    where = f" at step {step}" if step is not None else ""
    saved = f", checkpoint saved to {path}{hint}" if path is not None else ", no checkpoint named"
    message = f"preempted{how}{where}{saved}"
    note = os.environ.get(NOTE_VARIABLE)
    if note and local_rank == 0:
        Path(note).write_text(message + "\n")  # torchfleet's launcher prints it (report)
    elif not note and is_main:
        print(f"torchfleet: {message}", file=sys.stderr, flush=True)
    # Read by the launcher's summary when the workers alone got the signal and exited with the code.
    record_preempted(message)
    return Preempted(message)


class Leaving:
    """A script's side (Fleet.preempted, Fleet.leave). Listening starts at the first question, so a
    script that never asks keeps the signals' default action: a SIGTERM it would never act on is not
    swallowed. `signals` and `notice` default to what `torchfleet run` passed (its flags), else
    DEFAULT_SIGNALS and no notice."""

    def __init__(self, signals: str | None = None, notice: str | None = None):
        self.signals = signals or os.environ.get(SIGNALS_VARIABLE) or DEFAULT_SIGNALS
        self.notice = spot_notices.check_spec(notice or os.environ.get(NOTICE_VARIABLE) or "none")
        parse_signals(self.signals)  # a bad name is refused when the Fleet is made, not at the first step
        self.listener: Listener | None = None

    def asked(self, watch: bool) -> bool:
        """This process's flag; `watch`: this process is the one on its machine that polls the notices."""
        if self.listener is None:
            self.listener = listening(self.signals, self.notice, watch).__enter__()
        return self.listener.requested

    def leave(self, local_rank: int, is_main: bool, step: int | None, path: os.PathLike | str | None) -> Preempted:
        return leave(
            self.listener or Listener(()), local_rank, is_main, step, None if path is None else Path(path), hint=""
        )

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.__exit__(None, None, None)
            self.listener = None
