"""Everything that waits for a GPU, in one run that fits a short lease: `make gpu-check`.

    python benchmarks/gpu_check.py [--out runs/gpu-check] [--budget 420]   # on the GPU machine
    python benchmarks/gpu_check.py --plans-here runs/gpu-check             # afterwards, on any machine
    python benchmarks/gpu_check.py --dry-run     # the same steps on this CPU, tiny: checks the script

On a machine with one CUDA GPU and 16 cores it runs, within --budget seconds:
- the CUDA suite (tests/test_cuda.py and test_gpu_defaults.py, 4 workers when pytest-xdist is there);
- bench, serial on the GPU, one `torchfleet bench` per row of BENCH_RUNS: gpt's gpt2
  preset (its vocabulary padded to 50,304) at batch 32 in bf16 with fused AdamW, eager
  and whole-model compiled (the loss compiled with it); resnet50 at batches 128 and 512
  in fp32 and bf16 (channels-last, bf16's default on a GPU), and bf16 at 512 channels-first
  for the layout's share; the optional rows (compiled resnet50, SGD) while the budget
  allows. Each cell also runs 3 steps under torch.profiler (bench/kernels.py: where the
  time goes);
- `make cpu-scaling`'s measurement (benchmarks/parity.py --only scaling: free processes,
  the hand-written DDP loop and torchfleet's ddp) on 1, 2, 4 and 8 cores, in the
  background from the start, its processes pinned to the upper 8 cores and everything
  else to the lower 8, so neither slows the other by sharing a core.
It writes each part's output under --out, then summary.json and summary.md
(every table, and each target with its measured figure), and packs the folder
as OUT.tar.gz: with the two summaries, three files to bring back.
`--plans-here` then adds the planner's prediction (--gpu named from the
device, one GPU, serial, the cell's optimizer) beside each measured cell: the
planner needs no GPU, so its minutes of CPU are not spent from the lease.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The GPU machine runs this from a bare checkout (torchfleet not installed): summarise imports it too.
sys.path.insert(0, str(ROOT / "src"))
PARITY = ROOT / "benchmarks" / "parity.py"
GIB = 2**30
KERNEL_KINDS = ("matmul", "convolution", "attention", "layout", "normalization", "optimizer", "other")

# One `torchfleet bench` each, in this order: (name, model, preset, batches, precisions, extra flags, optional).
# An optional row runs only while the budget holds one more of the longest row's length.
GPT2 = ("gpt", "gpt2")
BENCH_RUNS = [
    ("gpt2-eager", *GPT2, [32], ["bf16"], ["--optimizer", "adamw"], False),
    ("gpt2-compiled", *GPT2, [32], ["bf16"], ["--optimizer", "adamw", "--compile", "model"], False),
    ("resnet50-eager", "resnet50", None, [128, 512], ["fp32", "bf16"], [], False),
    ("resnet50-channels-first", "resnet50", None, [512], ["bf16"], ["--no-channels-last"], False),
    ("resnet50-compiled", "resnet50", None, [512], ["bf16"], ["--compile", "model"], True),
    ("gpt2-sgd-compiled", *GPT2, [32], ["bf16"], ["--compile", "model"], True),
]
DRY_RUNS = [
    ("gpt-eager", "gpt", "tiny", [8], ["fp32"], ["--optimizer", "adamw"], False),
    ("gpt-compiled", "gpt", "tiny", [8], ["fp32"], ["--optimizer", "adamw", "--compile", "model"], False),
    ("resnet50-eager", "resnet50", None, [4], ["fp32", "bf16"], ["--image-size", "32"], False),
    ("resnet50-channels-last", "resnet50", None, [4], ["bf16"], ["--image-size", "32", "--channels-last"], True),
]


def _env(**extra) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
        **extra,
    }
    return env


def _pin(cores: list[int] | None):
    return (lambda: os.sched_setaffinity(0, cores)) if cores else None


class Run:
    def __init__(self, out: Path, budget: float, dry: bool):
        self.out, self.budget, self.dry, self.start = out, budget, dry, time.monotonic()
        self.log: list[dict] = []

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def step(
        self, name: str, cmd: list[str], timeout: float, env: dict | None = None, cores: list[int] | None = None
    ) -> dict:
        """Run `cmd`, its output in OUT/NAME.txt; one log entry with its exit status and seconds."""
        began = time.monotonic()
        with (self.out / f"{name}.txt").open("w") as fh:
            try:
                rc = subprocess.run(
                    cmd,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env or _env(),
                    cwd=ROOT,
                    timeout=max(5.0, timeout),
                    preexec_fn=_pin(cores),
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timed out"
        entry = {"step": name, "rc": rc, "seconds": round(time.monotonic() - began, 1)}
        self.log.append(entry)
        print(f"[{time.monotonic() - self.start:6.0f} s] {name}: {rc} in {entry['seconds']} s", flush=True)
        return entry


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _plan_gpu(name: str | None) -> str:
    return "H200" if name and "H200" in name else "H100"


def _bench_cmd(
    model: str, preset: str | None, batches: list[int], precisions: list[str], out: Path, extra: list[str], dry: bool
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torchfleet",
        "bench",
        "--model",
        model,
        "--strategies",
        "serial",
        "--batch-sizes",
        ",".join(map(str, batches)),
        "--precisions",
        ",".join(precisions),
        "--warmup",
        "3",
        "--steps",
        "10" if not dry else "3",
        "--out",
        str(out),
    ]
    return cmd + (["--gpt-preset", preset] if preset else []) + extra


def _plan_cmd(
    model: str, preset: str | None, batch: int, precision: str, optimizer: str, gpu: str, out: Path
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torchfleet",
        "plan",
        "--model",
        model,
        "--batch-size",
        str(batch),
        "--precision",
        precision,
        "--optimizer",
        optimizer,
        "--gpu",
        gpu,
        "--gpus-per-node",
        "1",
        "--strategies",
        "serial",
        "--nproc",
        "1",
        "--json-out",
        str(out),
    ]
    return cmd + (["--gpt-preset", preset] if preset else [])


def plans_here(out: Path) -> None:
    """The planner's prediction for every cell measured in `out`, made on this machine.

    The planner's profile of a model runs on the CPU and its GPU figures come from the datasheet
    table, so nothing of it needs the GPU: it runs after the lease, not during it (a gpt2 profile
    takes minutes of CPU, which the first lease paid for in benchmark time)."""
    info = json.loads((out / "info.json").read_text())
    folder = out / "plan"
    folder.mkdir(exist_ok=True)
    done = set()
    for c in _cells(out):
        key = (c["model"], c.get("gpt_preset"), c["global_batch"], c["precision"], c.get("optimizer", "sgd"))
        if c["status"] != "ok" or key in done:
            continue
        done.add(key)
        model, preset, batch, precision, optimizer = key
        preset = preset if model == "gpt" else None  # bench's config names its default preset for any model
        target = _plan_path(out, c)
        print(f"planning {model} {preset or ''} batch {batch} {precision} {optimizer} ...", flush=True)
        subprocess.run(
            _plan_cmd(model, preset, batch, precision, optimizer, _plan_gpu(info.get("gpu")), target),
            env=_env(CUDA_VISIBLE_DEVICES=""),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            check=False,
        )


def _cells(folder: Path) -> list[dict]:
    cells = []
    for path in sorted(folder.glob("bench-*/results.json")):
        doc = json.loads(path.read_text())
        cells += [{**c, "gpt_preset": doc["config"].get("gpt_preset")} for c in doc["cells"]]
    return sorted(cells, key=lambda c: (c["model"], c["global_batch"], c["precision"], c["compile"] != "off"))


def _plan_path(folder: Path, cell: dict) -> Path:
    name = f"{cell['model']}-b{cell['global_batch']}-{cell['precision']}-{cell.get('optimizer', 'sgd')}"
    return folder / "plan" / f"{name}.json"


def _predicted(folder: Path, cell: dict) -> dict | None:
    path = _plan_path(folder, cell)
    if not path.exists():
        return None
    p = json.loads(path.read_text())["predictions"][0]
    return {"step_s": p["time"]["step"], "peak_bytes": p["memory"]["peak"]}


def _kernels(folder: Path, cell: dict) -> dict | None:
    from torchfleet.bench.measure_cell import profile_name  # the name the cell wrote its kernels under

    spec = {**cell, "compile": None if cell["compile"] == "off" else cell["compile"]}
    path = folder / "kernels" / f"{profile_name(spec)}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def summarise(out: Path, info: dict, log: list[dict]) -> dict:
    cells = _cells(out)
    rows = []
    for c in cells:
        pred = _predicted(out, c)
        peak = max(c["peak_memory_bytes"]) if c.get("peak_memory_bytes") else None
        rows.append(
            {
                **{
                    k: c.get(k)
                    for k in (
                        "model",
                        "gpt_preset",
                        "global_batch",
                        "precision",
                        "compile",
                        "optimizer",
                        "channels_last",
                        "status",
                        "error",
                        "step_time_median_s",
                        "samples_per_s",
                        "tokens_per_s",
                        "mfu",
                        "model_tflops",
                        "vs_fp32",
                        "first_step_s",
                    )
                },
                "peak_bytes": peak,
                "predicted": pred,
                "step_ratio": (pred["step_s"] / c["step_time_median_s"])
                if pred and c.get("step_time_median_s")
                else None,
                "memory_ratio": (pred["peak_bytes"] / peak) if pred and peak else None,
                "kernels": _kernels(out, c),
            }
        )
    scaling_path = out / "scaling" / "parity.json"
    scaling = json.loads(scaling_path.read_text()).get("scaling") if scaling_path.exists() else None
    doc = {
        "info": info,
        "log": log,
        "cells": rows,
        "scaling": scaling,
        "suite": _suite(out),
        "targets": _targets(rows, scaling),
    }
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(doc))
    return doc


def _suite(out: Path) -> str | None:
    path = out / "suite.txt"
    if not path.exists():
        return None
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("=") and (" in " in ln)]
    return lines[-1].strip("= ") if lines else None


def _cell(rows, model, batch, precision, compiled, **wanted) -> dict | None:
    """The first measured row of these; `wanted` adds fields it must hold (optimizer, channels_last)."""
    return next(
        (
            r
            for r in rows
            if r["model"] == model
            and r["global_batch"] == batch
            and r["precision"] == precision
            and (r["compile"] != "off") == compiled
            and r["status"] == "ok"
            and all(r.get(k) == v for k, v in wanted.items())
        ),
        None,
    )


def _targets(rows: list[dict], scaling: dict | None) -> list[str]:
    said = []
    fp32 = _cell(rows, "resnet50", 512, "fp32", False)
    for layout, last in (("channels-last", True), ("channels-first", False)):
        bf16 = _cell(rows, "resnet50", 512, "bf16", False, channels_last=last)
        if fp32 and bf16:
            gain = fp32["step_time_median_s"] / bf16["step_time_median_s"]
            said.append(
                f"bf16 {layout} / fp32 on resnet50 at batch 512 (eager): x{gain:.2f}"
                + (" (target 1.6)" if last else " (before channels-last)")
            )
    gpt = _cell(rows, "gpt", 32, "bf16", True, optimizer="adamw") or _cell(rows, "gpt", 32, "bf16", False)
    if gpt and gpt["mfu"] is not None:
        said.append(
            f"gpt2 bf16 ({'compiled' if gpt['compile'] != 'off' else 'eager: no compiled cell ran'}):"
            f" MFU {gpt['mfu']:.1%} (target 40%)"
        )
    for name, key, bound in (("step time", "step_ratio", 0.2), ("memory", "memory_ratio", 0.1)):
        ratios = [r[key] for r in rows if r[key] is not None]
        if ratios:
            worst = max(ratios, key=lambda x: abs(x - 1))
            said.append(
                f"planner {name}, predicted / measured: median x{statistics.median(ratios):.2f},"
                f" worst x{worst:.2f} over {len(ratios)} cells (target within {bound:.0%})"
            )
    if scaling and "torchfleet" in scaling:
        eff = scaling["torchfleet"]["efficiency"]
        said.append(
            "cpu ddp scaling: "
            + ", ".join(f"{n} processes {e:.3f}" for n, e in eff.items())
            + " (targets 0.90 at 2, 0.80 at 8)"
        )
    return said


def markdown(doc: dict) -> str:
    info = doc["info"]
    lines = [
        f"# gpu-check: {info.get('gpu') or 'no GPU'}, torch {info['torch']}, {info['date']}",
        "",
        f"{info['cores']} cores; budget {info['budget_s']} s, took {info.get('took_s', '?')} s."
        f" CUDA suite: {doc['suite'] or 'no result'}.",
        "",
        "## Targets",
        "",
    ]
    lines += [f"- {t}" for t in doc["targets"]] or ["- none measured"]
    lines += [
        "",
        "## Bench (serial, one GPU) and the planner's prediction",
        "",
        "| model | batch | precision | compile | optimizer | layout | ms/step | samples/s | tokens/s | MFU |"
        " vs fp32 | peak GiB | first step s | predicted ms | predicted GiB | step pred/meas | mem pred/meas |",
        "|" + "---|" * 17,
    ]
    for r in doc["cells"]:
        pred = r["predicted"] or {}
        name = r["model"] + (f" {r['gpt_preset']}" if r["model"] == "gpt" else "")
        cell = f"| {name} | {r['global_batch']} | {r['precision']} | {r['compile']} | {r.get('optimizer') or 'sgd'} |"
        cell += f" {'NHWC' if r.get('channels_last') else 'NCHW' if r['model'].startswith('resnet') else '-'} |"
        if r["status"] != "ok":
            lines.append(f"{cell} {r['status']}: {r['error']} |" + " |" * 10)
            continue
        lines.append(
            f"{cell} {_fmt(r['step_time_median_s'], '.1f', 1e3)} | {_fmt(r['samples_per_s'], ',.0f')} |"
            f" {_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['mfu'], '.1%')} | {_fmt(r['vs_fp32'], '.2f')} |"
            f" {_fmt(r['peak_bytes'], '.2f', 1 / GIB)} | {_fmt(r['first_step_s'], '.1f')} |"
            f" {_fmt(pred.get('step_s'), '.1f', 1e3)} | {_fmt(pred.get('peak_bytes'), '.2f', 1 / GIB)} |"
            f" {_fmt(r['step_ratio'], '.2f')} | {_fmt(r['memory_ratio'], '.2f')} |"
        )
    lines += [
        "",
        "## Where the time goes (3 profiled steps a cell; ms per step)",
        "",
        "| model | batch | precision | compile | optimizer | layout | wall | "
        + " | ".join(KERNEL_KINDS)
        + " | no kernel |",
        "|" + "---|" * (8 + len(KERNEL_KINDS)),
    ]
    for r in doc["cells"]:
        k = r.get("kernels") or {}
        ms = k.get("kernel_ms_per_step", {})
        if "wall_ms_per_step" not in k:
            continue
        lines.append(
            f"| {r['model']} | {r['global_batch']} | {r['precision']} | {r['compile']} | {r.get('optimizer') or 'sgd'} |"
            f" {'NHWC' if r.get('channels_last') else '-'} | {k['wall_ms_per_step']:.1f} | "
            + " | ".join(_fmt(ms.get(kind), ".1f") for kind in KERNEL_KINDS)
            + f" | {k['no_kernel_share']:.0%} |"
        )
    for r in doc["cells"]:  # the language model's kernels by name: where an MFU short of its target goes
        top = (r.get("kernels") or {}).get("top_kernels_ms_per_step")
        if r["model"] == "gpt" and top:
            lines += ["", f"### Top kernels: gpt, {r['precision']}, compile {r['compile']} (ms per step)", ""]
            lines += [f"- {ms:.1f}: `{name}`" for name, ms in list(top.items())[:8]]
    if doc["scaling"]:
        lines += [
            "",
            "## CPU ddp scaling (CNN, 256 samples a process, 1 thread a process, cores 8-15)",
            "",
            "| way | 1 process samples/s | "
            + " | ".join(f"{n} processes (efficiency)" for n in next(iter(doc["scaling"].values()))["efficiency"])
            + " |",
            "|" + "---|" * (2 + len(next(iter(doc["scaling"].values()))["efficiency"])),
        ]
        for f in doc["scaling"].values():
            lines.append(
                f"| {f['label']} | {f['samples_per_s']['1']:,.0f} | "
                + " | ".join(f"{f['samples_per_s'][n]:,.0f} ({e:.3f})" for n, e in f["efficiency"].items())
                + " |"
            )
    lines += ["", "## Steps", "", "| step | exit | seconds |", "|---|---|---|"]
    lines += [f"| {e['step']} | {e['rc']} | {e['seconds']} |" for e in doc["log"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu-check")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 420)")
    parser.add_argument(
        "--plans-here",
        metavar="DIR",
        default=None,
        help="after the lease, on any machine: the planner's predictions for the cells measured in"
        " DIR (a gpu-check folder brought back), then DIR's summaries written again",
    )
    parser.add_argument("--scaling-rounds", default="1", help="cpu-scaling's rounds (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="tiny cells on this machine's CPU: checks the script")
    args = parser.parse_args()
    if args.plans_here:
        out = Path(args.plans_here).resolve()
        plans_here(out)
        summarise(out, json.loads((out / "info.json").read_text()), json.loads((out / "log.json").read_text()))
        print((out / "summary.md").read_text())
        return 0
    import torch

    gpu = _gpu_name()
    if gpu is None and not args.dry_run:
        sys.exit("gpu_check: torch here sees no CUDA GPU (use --dry-run to check the script on a CPU)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget, args.dry_run)
    cores = sorted(os.sched_getaffinity(0))
    low, high = (cores[:8], cores[8:16]) if len(cores) >= 16 else (None, None)
    info = {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cores": len(cores),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": args.budget,
        "python": sys.version.split()[0],
    }
    print(f"gpu-check: {gpu or 'no GPU (dry run)'}, torch {torch.__version__}, {len(cores)} cores", flush=True)

    # cpu-scaling in the background on the upper cores, from the start: it needs no GPU.
    counts, rounds, ways = (
        ("2", "1", "torchfleet,free") if args.dry_run else ("2,4,8", args.scaling_rounds, "free,hand,torchfleet")
    )
    scaling_cmd = [
        sys.executable,
        str(PARITY),
        "--only",
        "scaling",
        "--nprocs",
        counts,
        "--rounds",
        rounds,
        "--scaling-ways",
        ways,
        "--out",
        str(out / "scaling"),
    ]
    scaling_log = (out / "scaling.txt").open("w")
    scaling_began = time.monotonic()
    scaling = subprocess.Popen(
        scaling_cmd,
        stdout=scaling_log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=_env(CUDA_VISIBLE_DEVICES=""),
        preexec_fn=_pin(high),
    )
    if low:
        os.sched_setaffinity(0, low)  # every later child inherits the lower cores

    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi"], stdout=(out / "nvidia-smi.txt").open("w"), stderr=subprocess.STDOUT)
    run.step("doctor", [sys.executable, "-m", "torchfleet", "doctor"], 60)
    # The CUDA suite, on the lower cores: nothing is timed while it runs.
    xdist = subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True).returncode == 0
    suite = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/test_cuda.py",
            "tests/train/test_gpu_defaults.py",
            "-p",
            "no:cacheprovider",
            "-ra",
            "-o",
            "addopts=",
            *(["-n", "4"] if xdist else []),
            f"--junitxml={out / 'suite.xml'}",
        ],
        stdout=(out / "suite.txt").open("w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=_env(),
    )
    began = time.monotonic()
    try:
        rc = suite.wait(timeout=max(10.0, min(120.0, run.left() - 180)))
    except subprocess.TimeoutExpired:
        suite.kill()
        rc = "timed out"
    run.log.append({"step": "CUDA suite", "rc": rc, "seconds": round(time.monotonic() - began, 1)})

    kernels = _env(TORCHFLEET_BENCH_PROFILE=str(out / "kernels"))
    longest = 0.0
    for name, model, preset, batches, precisions, extra, optional in DRY_RUNS if args.dry_run else BENCH_RUNS:
        if optional and run.left() < longest + 10:
            run.log.append({"step": f"bench-{name}", "rc": "not run: budget", "seconds": 0})
            continue
        entry = run.step(
            f"bench-{name}",
            _bench_cmd(model, preset, batches, precisions, out / f"bench-{name}", extra, args.dry_run),
            run.left(),
            env=kernels,
        )
        longest = max(longest, entry["seconds"])

    try:
        scaling.wait(timeout=max(10.0, run.left() + 20))
        scaling_rc = scaling.returncode
    except subprocess.TimeoutExpired:
        scaling.kill()
        scaling_rc = "timed out"
    run.log.append({"step": "cpu-scaling", "rc": scaling_rc, "seconds": round(time.monotonic() - scaling_began, 1)})
    info["took_s"] = round(time.monotonic() - run.start)
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "log.json").write_text(json.dumps(run.log, indent=2) + "\n")
    doc = summarise(out, info, run.log)
    print((out / "summary.md").read_text(), flush=True)
    with tarfile.open(f"{out}.tar.gz", "w:gz") as tar:
        tar.add(out, arcname=out.name)
    print(f"wrote {out}/summary.md, summary.json and {out}.tar.gz", flush=True)
    return 0 if doc["cells"] else 1


if __name__ == "__main__":
    sys.exit(main())
