"""What a GPU draws and how fast it clocks while it trains at width (issue 37: a card at 500 W).

    python benchmarks/power_probe.py --out /tmp/power            # on the GPU machine, about 2 minutes
    python benchmarks/power_probe.py --out /tmp/power --dry-run  # tiny, on this CPU: checks the script

torchtitan's published Llama 3.1 runs used H100s held to 500 W; the planner's one efficiency was fitted
on H100 SXMs at their 700 W. Whether that difference can matter depends on what the card draws at its
own limit. This samples `nvidia-smi` (power, SM clock, the reasons the clock is held back) every 100 ms
through two phases, each long enough for the clock to settle:

- `gemm`: bf16 matrix products of 8192 x 8192, the card's best case, for --seconds;
- `llama`: scale_probe's real cell (Llama 3.1 8B's first four blocks, sequence 8192, local batch 2,
  torchtitan's selective checkpointing, FSDP2 on one rank, AdamW) for --steps steps.

It reads the card's state and changes none of its settings. Each phase's figures are the medians of the
samples taken while it ran, after its first quarter (the warm-up). Writes OUT/power.json and prints it.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("power.draw", "power.limit", "clocks.sm", "clocks.mem", "temperature.gpu", "utilization.gpu")


class Sampler:
    """`nvidia-smi` every 100 ms in the background; `samples(t0, t1)` is what it read between two instants."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, dict]] = []
        self.reasons = self._reasons_field()
        query = ",".join(FIELDS + (self.reasons,))
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    @staticmethod
    def _reasons_field() -> str:
        # Drivers from 535 name it clocks_event_reasons; older ones clocks_throttle_reasons.
        probe = ["nvidia-smi", "--query-gpu=clocks_event_reasons.active", "--format=csv"]
        known = subprocess.run(probe, capture_output=True).returncode == 0
        return "clocks_event_reasons.active" if known else "clocks_throttle_reasons.active"

    def _read(self) -> None:
        for line in csv.reader(self.proc.stdout):
            values = [v.strip() for v in line]
            # A line cut short when the sampler is stopped keeps the fields it has.
            self.rows.append((time.monotonic(), dict(zip(FIELDS + ("reasons",), values, strict=False))))

    def samples(self, began: float, ended: float) -> list[dict]:
        settled = began + (ended - began) / 4
        return [row for t, row in self.rows if settled <= t <= ended]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def summarise(rows: list[dict]) -> dict:
    def median(field: str):
        values = [float(r[field]) for r in rows if r.get(field, "").replace(".", "", 1).isdigit()]
        return round(statistics.median(values), 1) if values else None

    reasons = sorted({r.get("reasons", "") for r in rows})
    return {
        "samples": len(rows),
        "power_w": median("power.draw"),
        "power_limit_w": median("power.limit"),
        "sm_mhz": median("clocks.sm"),
        "mem_mhz": median("clocks.mem"),
        "temperature_c": median("temperature.gpu"),
        "utilization_pct": median("utilization.gpu"),
        # A bitmask: 0x4 is the software power cap, 0x20 and 0x40 thermal slowdowns (nvml's clocks event reasons).
        "reasons": reasons,
    }


def gemm(seconds: float, size: int, device: str) -> dict:
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    done, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        for _ in range(10):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        done += 10
    elapsed = time.perf_counter() - began
    return {"gemms": done, "tflops": round(2 * size**3 * done / elapsed / 1e12, 1)}


def llama(steps: int, dry_run: bool, device: str) -> dict:
    cell = {
        "part": "real",
        "shape": "tiny" if dry_run else "8b@4",
        "seq": 64 if dry_run else 8192,
        "batch": 2,
        "ac": "selective",
        "warmup": 2,
        "steps": steps,
        "device": device,
    }
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale_probe.py"), "--out", "/tmp", "--child", json.dumps(cell)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    rows = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("CELL ")]
    if not rows:
        return {"error": out.stderr[-600:]}
    row = rows[-1]
    # 989.4 TFLOP/s: the SXM H100's and H200's dense bf16 peak, against which the planner's 48% was fitted.
    row["efficiency"] = row["flops"] / (row["step_ms"] / 1e3) / 989.4e12 if row.get("flops") else None
    return {k: row.get(k) for k in ("step_ms", "tokens_per_s", "flops", "efficiency", "peak_gib", "error")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the gemm phase runs")
    parser.add_argument("--steps", type=int, default=120, help="how many steps the llama phase times")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    sampler = Sampler() if device == "cuda" and shutil.which("nvidia-smi") else None
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}
    phases = [
        ("gemm", lambda: gemm(1.0 if args.dry_run else args.seconds, 256 if args.dry_run else 8192, device)),
        ("llama", lambda: llama(2 if args.dry_run else args.steps, args.dry_run, device)),
    ]
    for name, run in phases:
        began = time.monotonic()
        figures = run()
        ended = time.monotonic()
        if sampler:
            figures.update(summarise(sampler.samples(began, ended)))
        result[name] = {**figures, "wall_s": round(ended - began, 1)}
        print(name, json.dumps(result[name]), flush=True)
    if sampler:
        sampler.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "power.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
