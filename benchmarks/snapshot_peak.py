"""What was alive at a CUDA memory snapshot's peak, grouped by the code that allocated it (issue 37).

    python benchmarks/snapshot_peak.py runs/stage-probe/snapshot-last-4-8-none.pickle [--top 25]

Reads a pickle written by torch.cuda.memory._dump_snapshot (stage_probe.py --snapshot writes one per
stage) and replays its allocation trace: each "alloc" adds a block, each "free_completed" removes it
(a "free_requested" whose block the allocator has not yet taken back, because another stream may still
use it, stays counted, as max_memory_allocated counts it). At the largest total it prints the live
blocks grouped by the innermost frame outside torch (the model's or the script's line) and by the
innermost torch function below it, with bytes, count and share. The trace starts where recording
started; blocks allocated before it are not seen, and their bytes are printed as the difference
between the trace's peak and the allocator's own peak if the snapshot says it.
"""

from __future__ import annotations

import argparse
import collections
import pickle
from pathlib import Path

GIB = 2**30


def _where(frames: list[dict]) -> tuple[str, str]:
    """(the innermost frame outside torch, the innermost torch frame), as file:line function."""
    torch_frame, own = "?", "?"
    for frame in frames:
        name = f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"
        inside_torch = "/torch/" in frame["filename"]
        if inside_torch and torch_frame == "?":
            torch_frame = name
        if not inside_torch and not frame["filename"].startswith("<") and own == "?":
            own = name
            break
    return own, torch_frame


def peak_blocks(trace: list[dict]) -> tuple[int, int, dict[int, dict]]:
    """(the peak's total bytes, its index in the trace, the blocks alive there by address)."""
    live: dict[int, dict] = {}
    total = best = best_at = 0
    for i, entry in enumerate(trace):
        action = entry["action"]
        if action == "alloc":
            live[entry["addr"]] = entry
            total += entry["size"]
            if total > best:
                best, best_at = total, i
        elif action == "free_completed" and entry["addr"] in live:
            total -= live.pop(entry["addr"])["size"]
    live = {}
    for entry in trace[: best_at + 1]:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
        elif entry["action"] == "free_completed":
            live.pop(entry["addr"], None)
    return best, best_at, live


def report(path: Path, top: int) -> str:
    snapshot = pickle.loads(path.read_bytes())
    traces = [t for t in snapshot.get("device_traces", []) if t]
    if not traces:
        return f"{path.name}: no allocation trace in the snapshot"
    trace = traces[0]
    best, best_at, live = peak_blocks(trace)
    groups: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for entry in live.values():
        group = groups[_where(entry.get("frames", []))]
        group[0] += entry["size"]
        group[1] += 1
    lines = [
        f"{path.name}: {len(trace)} trace entries, peak {best / GIB:.2f} GiB at entry {best_at}"
        f" (allocated at the peak: {_where(trace[best_at].get('frames', []))[0]}), {len(live)} live blocks"
    ]
    for (own, inner), (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / GIB:7.2f} GiB {100 * size / best:5.1f}% {count:6d}x  {own}  <-  {inner}")
    sizes = collections.Counter(e["size"] for e in live.values())
    lines.append(
        "  largest sizes alive: " + ", ".join(f"{n}x {s / 2**20:.0f} MiB" for s, n in sorted(sizes.items())[-8:])
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.snapshots:
        print(report(path, args.top), flush=True)


if __name__ == "__main__":
    main()
