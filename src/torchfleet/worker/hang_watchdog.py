"""Hang detection: heartbeats, every rank's Python stack, one verdict, a non-zero exit.

Every rank runs a small thread. The training loop calls `beat(step, phase)`
(an attribute write, nothing more); the thread publishes it in the process
group's key-value store once a second. Every thread also watches all the
heartbeats: when no rank's has moved for `timeout` seconds, the first thread
to notice claims the verdict (an atomic counter in the store), asks every
rank for its main thread's stack (each thread reads its own with
``sys._current_frames``, which works while the main thread waits inside a
collective, since collectives release the GIL), and writes one sentence:

    rank 1 on host-b has been in maybe_fire for 61 s at faults.py:63 (step 5);
    rank 0 waits in backward at precision.py:37 (step 6)

then exits with status 124 (as timeout(1) does). Under torchfleet's launcher
the sentence and the stacks become the failure summary, and the agent stops
the other ranks (or restarts the group under --max-restarts).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from torchfleet.launcher import failures

HANG_EXIT = 124
_TORCH_DIR = str(Path(torch.__file__).parent)
_STDLIB_DIR = str(Path(threading.__file__).parent)
# What a rank can wait in while a peer is missing: torch's collectives, and
# backward, where DDP's reducer waits for its gradient all-reduces.
_COLLECTIVES = {
    "all_reduce",
    "barrier",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "send",
    "recv",
    "wait",
    "monitored_barrier",
}
_STACK_WAIT = 10.0  # seconds to wait for every rank's stack once a hang is declared


class Watchdog:
    def __init__(self, rank: int, world_size: int, timeout: float, interval: float = 1.0):
        self.rank, self.world_size, self.timeout, self.interval = rank, world_size, timeout, interval
        self.host = socket.gethostname()
        self.step, self.phase, self.beats = 0, "starting", 0
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        if dist.is_initialized():
            # The default group's store: the one every rank already shares (torchrun's agent hosts it).
            self.store = dist.PrefixStore("torchfleet/watchdog", dist.distributed_c10d._get_default_store())
        else:
            self.store = dist.HashStore()
        self._thread = threading.Thread(target=self._run, name="torchfleet-watchdog", daemon=True)

    # -- the training loop's side -------------------------------------------------
    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self, step: int, phase: str = "train") -> None:
        self.step, self.phase = step, phase
        self.beats += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # -- the thread -------------------------------------------------------------
    def _run(self) -> None:
        seen: dict[int, int] = {}
        last_progress = time.monotonic()
        answered = False
        while not self._stop.wait(self.interval):
            try:
                self.store.set(f"hb/{self.rank}", json.dumps({"beats": self.beats, "step": self.step}))
                if not answered and self.store.check(["request"]):
                    self.store.set(f"stack/{self.rank}", json.dumps(self._my_report()))
                    answered = True
                beats = self._all_beats()
            except Exception:  # noqa: BLE001 - the store went away: the group is ending
                return
            if beats != seen:
                seen, last_progress = beats, time.monotonic()
            elif time.monotonic() - last_progress > self.timeout and self.store.add("claim", 1) == 1:
                self._declare(time.monotonic() - last_progress)

    def _all_beats(self) -> dict[int, int]:
        found = {}
        for r in range(self.world_size):
            key = f"hb/{r}"
            if self.store.check([key]):
                found[r] = json.loads(self.store.get(key))["beats"]
        return found

    def _my_report(self) -> dict:
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        stack = without_launcher_frames(
            [(f.filename, f.lineno, f.name) for f in traceback.extract_stack(frame)] if frame else []
        )
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase,
            "stack": stack,
        }

    def _declare(self, stalled: float) -> None:
        self.store.set("request", "1")
        self.store.set(f"stack/{self.rank}", json.dumps(self._my_report()))
        reports: dict[int, dict] = {}
        deadline = time.monotonic() + _STACK_WAIT
        while time.monotonic() < deadline and len(reports) < self.world_size:
            for r in range(self.world_size):
                if r not in reports and self.store.check([f"stack/{r}"]):
                    reports[r] = json.loads(self.store.get(f"stack/{r}"))
            time.sleep(0.2)
        text = verdict(reports, self.world_size, stalled)
        stacks = render_stacks(reports)
        if not failures.record_verdict(text, stacks):  # under the launcher, its summary shows it
            print(f"torchfleet: hang: {text}\n{stacks}", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT)


# -- reading stacks ---------------------------------------------------------------
def _is_ours(filename: str) -> bool:
    return not (filename.startswith(_TORCH_DIR) or filename.startswith(_STDLIB_DIR))


# How a worker came to run the user's code, which says nothing about where it hangs: a forked worker's
# frames of the forkserver, multiprocessing and torch's wrappers, train's worker_main, and `python -m`'s runpy.
_LAUNCHER_FRAMES = (
    "/multiprocessing/",
    "torch/distributed/elastic/",
    "torchfleet/launcher/failures.py",
    "torchfleet/train/command.py",
    "<frozen runpy>",
    "<string>",
)


def without_launcher_frames(stack: list) -> list:
    """`stack` (outermost first) from the first frame that is not the launcher's own way in."""
    for i, (filename, _, _) in enumerate(stack):
        if not any(part in filename for part in _LAUNCHER_FRAMES):
            return stack[i:]
    return stack


def describe(stack: list) -> tuple[str, str, bool]:
    """(what the rank is in, where in user code, whether that is waiting for peers)."""
    activity, waiting = None, False
    for filename, _, name in reversed(stack):
        if filename.startswith(_TORCH_DIR) and name in _COLLECTIVES:
            activity, waiting = name, True
            break
        if filename.startswith(_TORCH_DIR) and name == "backward":
            activity, waiting = "backward", True
            break
    ours = [f for f in stack if _is_ours(f[0])]
    if not ours:
        return activity or "native code", "an unknown place", waiting
    filename, line, name = ours[-1]
    return activity or name, f"{os.path.basename(filename)}:{line}", waiting


def verdict(reports: dict[int, dict], world_size: int, stalled: float) -> str:
    """One sentence: who is stuck where, and who waits for them."""
    silent = [r for r in range(world_size) if r not in reports]
    described = {r: (*describe(rep["stack"]), rep) for r, rep in reports.items()}
    culprits = [r for r, (_, _, waiting, _) in described.items() if not waiting]
    if not culprits and not silent and described:
        steps = {r: rep["step"] for r, (*_, rep) in described.items()}
        low = min(steps.values())
        culprits = [r for r, s in steps.items() if s == low] if len(set(steps.values())) > 1 else []
    parts = []
    for r in sorted(culprits):
        what, where, _, rep = described[r]
        parts.append(
            f"rank {r} on {rep['host']} has been in {what} for {stalled:.0f} s at {where} (step {rep['step']})"
        )
    for r in silent:
        parts.append(
            f"rank {r} did not answer in {_STACK_WAIT:.0f} s (stuck in native code holding the GIL, or frozen)"
        )
    waiters = [r for r in sorted(described) if r not in culprits]
    if not parts:
        what, where, _, rep = described[waiters[0]]
        return (
            f"no rank has made progress for {stalled:.0f} s: all ranks wait in {what} at {where} (step {rep['step']});"
            " they disagree on which collective comes next, or the network dropped it"
        )
    groups: dict[tuple[str, str, int], list[int]] = {}
    for r in waiters:
        what, where, _, rep = described[r]
        groups.setdefault((what, where, rep["step"]), []).append(r)
    for (what, where, step), ranks in groups.items():
        who = f"rank {ranks[0]} waits" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} wait"
        parts.append(f"{who} in {what} at {where} (step {step})")
    return "; ".join(parts)


def render_stacks(reports: dict[int, dict]) -> str:
    lines = []
    for r in sorted(reports):
        rep = reports[r]
        lines.append(f"rank {r} on {rep['host']} (pid {rep['pid']}), step {rep['step']}, main thread:")
        lines.extend(f'  File "{f}", line {n}, in {name}' for f, n, name in rep["stack"])
    return "\n".join(lines)
