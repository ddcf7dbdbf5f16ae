"""Workers of `launch` forked from a server that imported torch once, not each started from nothing.

A spawned worker is a new interpreter that imports torch, torch.distributed
and torchfleet before it runs a line of the function: about 3 s of a core
each on a 2-core machine, which is most of a short job and all of a test's.
multiprocessing's forkserver is one single-threaded process that imports
them once (`PRELOAD`); every worker after that is a fork of it, started in
milliseconds with those modules in place. torch's agent supports it as a
start method, and a function entrypoint's worker is the same either way
(pickled function and arguments, its own process, its own exit status).

One difference is made good here: a forked worker inherits the server's
environment, taken when the server started, not the launcher's now. The
server records its environment as it imports this module (`SERVER_ENVIRON`);
each worker then rebuilds the environment the launcher had when it started
the workers (`environ`, carried with the function), and keeps what torch's
agent set for it on top (RANK, MASTER_ADDR, ...: whatever differs from the
server's). The working directory and sys.path come with multiprocessing's
own preparation data, as for a spawned worker.
"""

from __future__ import annotations

import multiprocessing
import os

import torch

# Recorded in the server as it preloads this module; a process that imports it itself has its own.
SERVER_ENVIRON = dict(os.environ)
SERVER_PID = os.getpid()
SERVER_THREADS = torch.get_num_threads()  # torch's default here, which a worker without OMP_NUM_THREADS keeps

START_METHOD = "forkserver"
in_worker = False  # True in a worker forked from the server, once its environment is restored
# What a worker of a distributed job imports anyway; the server imports it once.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torchfleet.launcher.forked",
    "torchfleet.fleet",
    "torchfleet.cli",
    "torchfleet.train.command",
    "torchfleet.train.loop",
    "torch._dynamo",
]


def _server_state():
    from multiprocessing import forkserver

    return forkserver._forkserver  # multiprocessing's private state: whether a server runs, and what it preloaded


def server_pid() -> int | None:
    """The pid of the forkserver this process started, whose children `launch`'s workers are; None if none."""
    return getattr(_server_state(), "_forkserver_pid", None)


def start_method() -> str:
    """ "forkserver", the server started now (before the launcher exports the workers' variables, so that torch
    reads none of them as it is imported there); "spawn" where this process already runs a server started
    without this module (by the user's own code), whose workers could not be given their environment."""
    from multiprocessing import forkserver

    if server_pid() is not None and __name__ not in (getattr(_server_state(), "_preload_modules", None) or []):
        return "spawn"
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    return START_METHOD


def restore_environ(launcher_environ: dict[str, str]) -> None:
    """In a worker forked from the server: the launcher's environment, with what torch's agent set for this
    worker on top. Nothing in a worker that imported this module itself (spawned: its environment is right)."""
    global in_worker
    if SERVER_PID == os.getpid():
        return
    in_worker = True
    set_by_agent = {k: v for k, v in os.environ.items() if SERVER_ENVIRON.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_environ)
    os.environ.update(set_by_agent)
    # torch took its thread count from the server's environment as it was imported there; a spawned worker
    # takes it from its own (the launcher sets OMP_NUM_THREADS=1 for several processes on one machine).
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else SERVER_THREADS)
    _name_process(f"tf-rank{os.environ.get('RANK', '?')}")


def _name_process(name: str) -> None:
    """Name this process `name` where ps, top and /proc/PID/comm show it (Linux, 15 bytes at most): forked
    workers share the server's command line, and an environment set after the fork is not in
    /proc/PID/environ either, so this is how a person (or a test) tells one rank's process from another."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: the name is a convenience
