"""The command line in a process of its own, without paying torch's import each time.

`python -m torchfleet ...` spends about two seconds of a two-core machine
importing torch before it parses a flag, and a suite that checks dozens of
bad inputs and help pages pays that dozens of times. `forked_cli` runs the
same `torchfleet.cli.main` in a child forked from a single-threaded server
that imported it once (multiprocessing's forkserver). The child is a real
process with its own environment, working directory, file descriptors 1 and
2 and exit status, so whatever a user's process would print or return, this
one does too: a traceback still shows up on stderr, an exit code is still the
interpreter's. What it skips is only the interpreter's start and the imports.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile

from torchfleet.launcher import forked

# What the commands import before they refuse or print help (torch, sympy, rich and the
# package's own modules); anything else a command needs, its child imports itself.
# One forkserver serves a process: it also forks `launch`'s workers, whose modules it preloads too (forked.py).
_PRELOAD = [
    "torch",
    "sympy",
    "rich",
    "torchfleet.cli",
    "torchfleet.cli.bench",
    "torchfleet.cli.clusters",
    "torchfleet.train.command",
    "torchfleet.launcher.torchrun_flags",
    "torchfleet.doctor",
    *forked.PRELOAD,
]
_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    # Fresh streams over the new descriptors, line-buffered, so nothing waits in them at exit.
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from torchfleet.cli import main

    sys.exit(main(argv))  # multiprocessing turns SystemExit into the exit status, as the interpreter does


def forked_cli(argv: list[str], env: dict[str, str], cwd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`torchfleet *argv` with `env` in `cwd`: its exit status, stdout and stderr, as subprocess.run gives them."""
    with tempfile.TemporaryDirectory(prefix="torchfleet-cli-") as scratch:
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        for path in (out, err):
            open(path, "w").close()
        child = _server().Process(target=_child, args=(list(argv), dict(env), str(cwd), out, err))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["torchfleet", *argv], timeout)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(["torchfleet", *argv], child.exitcode, o.read(), e.read())
