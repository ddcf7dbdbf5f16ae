"""One readable account of a failed job: which rank, where, how, and why.

Workers started by torchfleet record an uncaught exception in the error file
that torchrun's agent names in ``TORCHELASTIC_ERROR_FILE`` (the agent's own
JSON format, plus the host and rank) and exit without printing the traceback
themselves, so the launcher shows it exactly once, in the summary.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field

from torchfleet.errors import TrainingError, UsageError

# Exit status of a worker that failed on bad input: the launcher exits 2 as well.
USAGE_EXIT = 2
# Exit status of a job that was told to leave (SIGTERM, SIGUSR1: worker/preemption.py) and saved its
# checkpoint first: sysexits.h's EX_TEMPFAIL, "a temporary failure, retry later". It is neither 1
# (a failure), 2 (bad input) nor 128+N (killed by signal N), so a Kubernetes podFailurePolicy
# (onExitCodes) or a Slurm script can tell it apart and requeue.
PREEMPTED_EXIT = 75


@dataclass
class RankFailure:
    rank: int
    local_rank: int
    host: str
    pid: int
    exitcode: int
    error: str = ""  # "ValueError: boom", empty when the process died without a word
    traceback: str = ""
    usage_error: bool = False
    verdict: bool = False  # error is the watchdog's hang verdict, traceback every rank's stack
    finished: bool = False  # its script had run to its end: it died afterwards, while exiting
    preempted: bool = False  # told to leave, it saved a checkpoint: error is the sentence saying where

    @property
    def how(self) -> str:
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"killed by {name}"
        return f"exit code {self.exitcode}"


@dataclass
class FailureSummary:
    first: RankFailure
    others: list[RankFailure] = field(default_factory=list)

    def render(self) -> str:
        f = self.first
        if f.usage_error:
            return f.error.split(": ", 1)[-1]
        if f.preempted:
            return f.error
        if f.verdict:
            return f"hang: {f.error}\n{f.traceback}"
        lines = [f"rank {f.rank} (local rank {f.local_rank} on {f.host}, pid {f.pid}) failed first: {f.how}"]
        if f.traceback:
            lines.append(f.traceback.rstrip())
        elif f.error:
            lines.append(f.error)
        elif f.finished:
            lines.append(f"it had run its script to the end and {_DIED_AFTER}")
        else:
            lines.append("it left no error report: it was killed, or exited before Python could record why")
        for o in self.others:
            note = o.error or ("after its script had run to the end" if o.finished else "")
            lines.append(f"rank {o.rank} on {o.host} also failed: {o.how}" + (f" ({note})" if note else ""))
        return "\n".join(lines)

    @property
    def exit_status(self) -> int:
        if self.first.usage_error:
            return USAGE_EXIT
        if self.first.preempted:
            return PREEMPTED_EXIT
        code = self.first.exitcode
        return 128 + (-code) if code < 0 else (code or 1)


# What comes after a script's end and can still kill the process, leaving no report of its own.
_DIED_AFTER = (
    "died afterwards, while the process exited (in an atexit handler, or in torch's own teardown"
    " such as a process group's destructor)"
)


# What a rank says when it fails only because a peer died first.
# When every rank has one, the earliest is the cause.
_ECHOES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "Socket Timeout",
    "DistBackendError",
    "gloo/transport",
)


def _is_echo(failure: RankFailure) -> bool:
    """True for a failure caused by another's: the agent's SIGTERM, a vanished peer."""
    return failure.exitcode == -signal.SIGTERM or any(e in failure.error for e in _ECHOES)


def summarize(exc) -> FailureSummary:
    """Turn torchrun's ChildFailedError into a FailureSummary, the root cause first.

    The agent's timestamps have one-second resolution, so two ranks often
    fail "at once"; a rank that failed because its peer vanished is an echo,
    and the rank that failed on its own comes first. A rank that had finished
    its script comes after those that failed in theirs: its record's time is
    when the script ended, not when the process died.
    """
    found = []
    for rank, failure in exc.failures.items():
        data = failure.error_file_data.get("message", {}) if failure.error_file_data else {}
        info = data.get("extraInfo", {}) if isinstance(data, dict) else {}
        message = data.get("message", "") if isinstance(data, dict) else str(data)
        found.append(
            (
                failure.timestamp,
                RankFailure(
                    rank=rank,
                    local_rank=failure.local_rank,
                    host=info.get("host", socket.gethostname()),
                    pid=failure.pid,
                    exitcode=failure.exitcode,
                    error="" if message == "<NONE>" else message,
                    traceback=info.get("py_callstack", ""),
                    usage_error=bool(info.get("usage_error")),
                    verdict=bool(info.get("verdict")),
                    finished=bool(info.get("finished")),
                    preempted=bool(info.get("preempted")) and failure.exitcode == PREEMPTED_EXIT,
                ),
            )
        )
    found.sort(key=lambda pair: (_is_echo(pair[1]), pair[1].finished, pair[0], pair[1].rank))
    ranked = [f for _, f in found]
    return FailureSummary(ranked[0], ranked[1:])


def report(summary: FailureSummary) -> int:
    """Print the summary on stderr; return the exit status for the shell."""
    # A preemption with its checkpoint saved is no error: the job is to be resumed.
    kind = "" if summary.first.preempted else "error: "
    print(f"torchfleet: {kind}{summary.render()}", file=sys.stderr, flush=True)
    return summary.exit_status


def first_cause(exc: BaseException) -> BaseException:
    """The exception that started it all: one raised while handling another is not the cause.

    Python keeps the exception being handled as ``__context__`` of one raised
    meanwhile (a cleanup that failed too); ``raise ... from`` sets
    ``__cause__`` instead, which is a deliberate translation and is kept.
    """
    seen = {id(exc)}
    while (
        exc.__cause__ is None
        and exc.__context__ is not None
        and not exc.__suppress_context__
        and id(exc.__context__) not in seen
    ):
        exc = exc.__context__
        seen.add(id(exc))
    return exc


def describe(exc: BaseException) -> str:
    """One line for a failure: the first cause, and what went wrong while handling it."""
    root = first_cause(exc)
    text = f"{type(root).__name__}: {root}"
    if root is not exc:
        text += f" (then, while handling it, {type(exc).__name__}: {exc})"
    return text


# Modules whose frames lie between a worker's start and the user's code: runpy runs the
# script as __main__ (its frames are "<frozen runpy>" on Python 3.11+), and this one's
# call_recorded catches what the script raised.
_LAUNCH_MODULES = {"runpy", __name__}


def user_traceback(exc: BaseException) -> str:
    """`exc`'s traceback as Python prints it, starting at the user's frame, not the launcher's."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in _LAUNCH_MODULES:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def record_exception(exc: BaseException) -> bool:
    """Write `exc` to the agent's error file; False when not under torchrun's agent."""
    # A TrainingError's sentence says all (step and rank): no traceback to go with it.
    callstack = "" if isinstance(exc, TrainingError) else user_traceback(exc)
    root = first_cause(exc)
    return _record(describe(exc), callstack, usage_error=isinstance(root, UsageError))


def record_verdict(verdict: str, stacks: str) -> bool:
    """Write the watchdog's hang verdict and every rank's stack to the agent's error file."""
    return _record(verdict, stacks, verdict=True)


def record_finished() -> bool:
    """Note in the agent's error file that the script ran to its end; False when not under the agent.

    A rank that then dies while exiting (an atexit handler, a Gloo abort in
    torch's teardown) is still a failure to the agent, which reads this file
    for every failed rank; the summary can then say the script's work was done.
    A rank that exits cleanly is never asked about it.
    """
    return _record("", "", finished=True)


def record_preempted(message: str) -> bool:
    """Note in the agent's error file that this rank saved and leaves with PREEMPTED_EXIT, and why
    (`message`); False when not under the agent."""
    return _record(message, "", preempted=True)


def _record(message: str, callstack: str, **flags: bool) -> bool:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(time.time())),
                "host": socket.gethostname(),
                "rank": os.environ.get("RANK", "?"),
                **flags,
            },
        }
    }
    # Through a temporary file: the agent may stop this process at any moment,
    # and an error file it finds empty makes older agents (torch 2.11) fail to
    # parse it and abort the whole launch instead of restarting the group.
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)
    return True


def call_recorded(fn, *args):
    """Run fn(*args) in a worker; on an exception, record it and exit quietly."""
    try:
        return fn(*args)
    except SystemExit as exc:
        if exc.code in (None, 0) or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            raise
        # A worker that asks to fail leaves at once with its code. Python's
        # teardown would close the process group first; the peers then fail on
        # the closed connection, and the agent, seeing them first, stops this
        # process with SIGTERM and loses the code (seen on torch 2.11).
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # what Python prints for sys.exit("message")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.code if isinstance(exc.code, int) else 1)
    except Exception as exc:
        if not record_exception(exc):
            raise
        # Leave at once: a clean exit would tear down the process group first,
        # which waits on peers that are themselves waiting for this rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(USAGE_EXIT if isinstance(exc, UsageError) else 1)


class Recorded:
    """`fn` wrapped by `call_recorded`, picklable and named (the agent reads __name__); with `as_bytes`, its
    result comes back pickled (plain pickle: tensors as bytes, not as shared memory)."""

    def __init__(self, fn, as_bytes: bool = False):
        self.fn = fn
        self.as_bytes = as_bytes
        self.environ: dict[str, str] | None = None  # the launcher's, for a worker forked from a server (forked.py)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args):
        if self.environ is not None:
            from torchfleet.launcher import forked

            forked.restore_environ(self.environ)
        result = call_recorded(self.fn, *args)
        return pickle.dumps(result) if self.as_bytes else result
