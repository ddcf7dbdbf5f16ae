"""A test hook that makes one rank fail on purpose, so fault handling is tested for real.

    TORCHFLEET_FAULT=kill:rank=1:step=7:once=/tmp/fired

The trainer calls `maybe_fire(rank, step)` after every optimizer step. On
rank `rank` after step `step` the fault fires:

    kill    SIGKILL this process (what the OOM killer or a lost node looks like)
    raise   raise RuntimeError (a crash with a traceback)
    sleep   sleep `seconds` (default 3600) without a word: a hang
    nan     return True: the trainer then treats the loss as NaN
    pace    from `step` on, sleep `seconds` after every step until FILE
            (``until=FILE``) exists: a rank kept slow, but stepping, until
            something else has happened (a lost peer back and healed)
    slow    from `step` on, one phase of each step slow (``phase=``): data
            sleeps `seconds` inside each fetch from the loader (a slow disk);
            compute wakes a busy thread in the rank's process at the start
            of each forward, which keeps the interpreter and a core for
            `seconds` (a noisy neighbour); for the straggler verdicts
            (run_services/stragglers.py)

``once=FILE`` fires only while FILE does not exist and writes it (holding
the time it fired) just before firing, so a group restarted by torchrun's
agent does not fire again. This is for tests and drills, not for training.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchfleet.errors import UsageError

VARIABLE = "TORCHFLEET_FAULT"
KINDS = ("kill", "raise", "sleep", "nan", "pace", "slow")
SLOW_PHASES = ("data", "compute")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    once: str | None = None
    seconds: float = 3600.0
    until: str | None = None  # pace's end: when this file exists
    phase: str | None = None  # slow's phase: data or compute


def parse(text: str) -> Fault:
    kind, *fields = text.split(":")
    try:
        values = dict(f.split("=", 1) for f in fields)
        fault = Fault(
            kind,
            int(values.pop("rank")),
            int(values.pop("step")),
            values.pop("once", None),
            float(values.pop("seconds", 3600)),
            values.pop("until", None),
            values.pop("phase", None),
        )
    except (ValueError, KeyError):
        fault = None
    if (
        fault is None
        or kind not in KINDS
        or values
        or (kind == "pace") != (fault.until is not None)
        or (kind == "slow") != (fault.phase in SLOW_PHASES)
    ):
        raise UsageError(
            f"{VARIABLE}={text!r} is not a fault; use e.g. kill:rank=1:step=7[:once=FILE],"
            f" pace:rank=0:step=7:seconds=0.2:until=FILE or slow:rank=2:step=1:phase=data:seconds=0.05"
            f" (phase data or compute), with kind one of {', '.join(KINDS)}"
        )
    return fault


def _configured() -> Fault | None:
    text = os.environ.get(VARIABLE)
    return parse(text) if text else None


def maybe_fire(rank: int, step: int) -> bool:
    """Fire the configured fault if it is due here; True means "pretend the loss is NaN"."""
    fault = _configured()
    if fault is None or fault.rank != rank:
        return False
    if fault.kind == "slow":
        return False
    if fault.kind == "pace":
        if step >= fault.step and fault.until and not os.path.exists(fault.until):
            time.sleep(fault.seconds)
        return False
    if fault.step != step:
        return False
    if fault.once:
        marker = Path(fault.once)
        if marker.exists():
            return False
        marker.write_text(f"{time.time()}\n")  # survives the restart; holds when it fired
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "raise":
        raise RuntimeError(f"fault injected by {VARIABLE} on rank {rank} at step {step}")
    if fault.kind == "sleep":
        time.sleep(fault.seconds)
    return fault.kind == "nan"


def slow_fetch(rank: int, step: int) -> None:
    """Before fetching `step`'s batch: a slow:phase=data fault's sleep, when it is due here."""
    fault = _configured()
    if fault is not None and fault.kind == "slow" and fault.phase == "data" and fault.rank == rank:
        if step >= fault.step:
            time.sleep(fault.seconds)


def slow_compute(rank: int) -> Callable[[int], None] | None:
    """A slow:phase=compute fault's busy thread, started here; the returned callable wakes it for a step.

    The thread is a noisy neighbour inside the rank's own process, as a logging or prefetch thread doing
    pure-Python work would be: woken at the start of a forward, it spins for `seconds`, holding the
    interpreter, and the training thread, which needs the interpreter between any two torch ops, waits
    for it: each slowed step's compute takes `seconds` longer. A thread that only burns a core (work that
    lets go of the interpreter) slows nothing that can be named on a machine whose cores every rank
    already shares: the scheduler takes its share from all the ranks alike. Pinning the rank and a
    thread of raised priority to one core named rank 2 too, on 2 cores, but its compute grew by 1 to 34
    ms a step where 30 were asked (the rest landed in communication), and a raised priority needs root.
    (A free-threaded Python has no interpreter lock to hold; this fault needs one.)

    Two things make the neighbour's turn fall whole inside compute. The training thread waits until the
    busy thread holds the interpreter (else it would finish a short forward before the thread ran, and
    the turn would land in the gradient sync); and the switch interval is raised above `seconds` in this
    process, so the turn ends when the thread's spinning does, as a long C call's would, rather than
    after the default 5 ms.
    """
    fault = _configured()
    if fault is None or fault.kind != "slow" or fault.phase != "compute" or fault.rank != rank:
        return None
    due, holding = threading.Event(), threading.Event()
    sys.setswitchinterval(max(sys.getswitchinterval(), 2 * fault.seconds))

    def spin() -> None:
        while True:
            due.wait()
            due.clear()
            end = time.perf_counter() + fault.seconds
            holding.set()
            while time.perf_counter() < end:  # pure Python: the interpreter stays with this thread
                pass

    threading.Thread(target=spin, name="torchfleet-busy", daemon=True).start()

    def wake(step: int) -> None:
        if step >= fault.step:
            holding.clear()
            due.set()
            holding.wait()

    return wake
