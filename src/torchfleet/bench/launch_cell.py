"""One cell of the matrix measured in its own processes, through the launcher, under a deadline: always a row."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path

from torchfleet.bench import measure_cell as bench_cell
from torchfleet.bench.cells import Cell, preset_degrees, variant
from torchfleet.bench.config import BenchConfig
from torchfleet.launcher.agent import LaunchError, launch
from torchfleet.models import TOKEN_MODELS, gpt_config
from torchfleet.strategies import STRATEGIES
from torchfleet.strategies.dims import DIM_NAMES


def _worker_processes() -> list[int]:
    """The cell's worker processes: children of this process started by multiprocessing's spawn, or children
    of the forkserver this process started, which `launch` forks its workers from (launcher/forked.py)."""
    from torchfleet.launcher import forked

    server = forked.server_pid()
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if (ppid == me and b"spawn_main" in cmdline) or (server is not None and ppid == server):
            found.append(int(entry.name))
    return found


class _Deadline:
    """Kill the cell's workers when it runs past `seconds`; the launcher then reports them failed.

    After the deadline it keeps killing once a second, so workers that were
    still being started at that moment do not escape.
    """

    def __init__(self, seconds: float):
        self.seconds, self.expired = seconds, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if self._stop.wait(self.seconds):
            return
        self.expired = True
        while not self._stop.is_set():
            for pid in _worker_processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._stop.wait(1.0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def failure_reason(summary) -> str:
    """One line saying why a cell failed, from the launcher's failure summary."""
    first = summary.first
    if first.usage_error:
        text = first.error.split(": ", 1)[-1]
    elif first.error:
        text = f"rank {first.rank}: {first.error}"
    else:
        text = f"rank {first.rank} {first.how}"
        if first.how == "killed by SIGKILL":
            text += " (the kernel's OOM killer does this when memory runs out)"
    text = text.strip().splitlines()[0] if text.strip() else "no reason recorded"
    return text if len(text) <= 300 else text[:297] + "..."


def run_one(cell: Cell, cfg: BenchConfig, profile: bool = True) -> dict:
    """Measure `cell` in its own processes; always returns a row, never raises for the cell's failure.
    `profile`: whether its ranks profile their kernels after the timed steps (bench/kernels.py)."""
    row = {
        "model": cfg.model,
        **asdict(cell),
        "compile": cfg.compile or "off",
        "optimizer": cfg.optimizer,
        "warmup": cfg.warmup,
        "steps": cfg.steps,
    }
    row.pop("threads")
    row["threads_per_process"] = cell.threads
    row.pop("skip")
    if cell.skip:
        return {**row, "status": "skipped", "error": cell.skip}
    base, extra = variant(cell.strategy)
    cls = STRATEGIES[base]
    preset = cfg.gpt_preset or "tiny"  # resolve() has chosen; an unresolved config gets the CPU's choice
    if cfg.model in TOKEN_MODELS:
        row["tokens_per_sample"] = gpt_config(preset).block_size
    spec = {
        "model": cfg.model,
        "gpt_preset": preset,
        "image_size": cfg.image_size,
        "strategy": base,
        "processes": cell.processes,
        "global_batch": cell.global_batch,
        "precision": cell.precision,
        "threads": cell.threads,
        "warmup": cfg.warmup,
        "steps": cfg.steps,
        "round_time_s": cfg.round_time_s,
        "seed": cfg.seed,
        "profile": profile,
        "compile": cfg.compile,
        "optimizer": cfg.optimizer,
        "channels_last": cfg.channels_last,
        # each strategy gets only the options it takes: --microbatches is for mp and pipeline,
        # and a degree flag only for the presets that have that dimension (--pp not for ddp)
        "options": {
            **{
                k: v
                for k, v in cfg.strategy_options.items()
                if k in cls.takes and (k not in DIM_NAMES or k in preset_degrees(base))
            },
            **extra,
        },
    }
    start = time.perf_counter()
    try:
        with _Deadline(cfg.cell_timeout_s) as deadline:
            figures = launch(bench_cell.run_cell, nprocs=cell.processes, args=(spec,))[0]
    except LaunchError as exc:
        reason = f"timed out after {cfg.cell_timeout_s:g} s" if deadline.expired else failure_reason(exc.summary)
        return {**row, "status": "failed", "error": reason, "wall_s": time.perf_counter() - start}
    return {**row, **figures, "status": "ok", "error": None, "wall_s": time.perf_counter() - start}
