"""Host memory and time of loading a ~1B Llama from safetensors shard by shard, against from_pretrained.

    python benchmarks/weights_memory.py                   # writes the model once, then every case
    python benchmarks/weights_memory.py --cases fsdp,tp   # some of them
    python benchmarks/weights_memory.py --dir /big/disk/llama-1b --json-out weights.json

The model: TinyLlama-1.1B's shape (Llama's architecture: 22 blocks of width 2048, 32 heads, 4 key/value
heads, a vocabulary of 32,000, the head not tied), its random weights written once as fp32 safetensors
in shards of at most 2 GB with their index (4.4 GB), the way save_pretrained writes them.

Each case starts fresh processes (a process's resident peak cannot be reset):
- from_pretrained: one process, transformers' AutoModelForCausalLM.from_pretrained(DIR, dtype=float32), which
  maps the files and reads nothing yet; then every weight read once (what a first forward pays: "touched");
- fsdp, tp, pipeline: 2 CPU processes (Gloo), each building the model on the meta device
  (fleet.init_module) and `fleet.setup(model, SGD, weights=DIR)`, taking only its share (mapped where it
  is one run of a file's bytes, as from_pretrained's weights are; TORCHFLEET_MAP_WEIGHTS=0 reads it all);
  then every weight it holds read once, likewise.
For each process: its resident set's peak during the build and the load, above what it held just
before (the kernel's peak, reset first, so a peak reached earlier, in the imports, does not hide it),
over the model's bytes; the wall time of the build and the load (the slowest rank's), and its CPU time
(every thread, user and system; the slowest rank's), which a loaded machine stretches less.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from pathlib import Path

import torch

SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SHARD_BYTES = 2 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    """This process's CPU time (every thread, user and system): what the work costs, however loaded the machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def resident() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class PeakResident:
    """The resident set's peak while open, above what it was on entering: the kernel's own peak (VmHWM), reset
    on entering by writing 5 to /proc/self/clear_refs (Linux 4.0 and later), so a peak reached earlier (in the
    imports) does not hide it, and no sampling thread takes the interpreter's lock from the work measured."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        self.start = resident()
        return self

    def __exit__(self, *exc):
        with open("/proc/self/status") as fh:
            peak = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
        self.growth = peak - self.start


def write_model(directory: Path) -> int:
    """The model's random weights as save_pretrained lays them out, one tensor in memory at a time; its bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torchfleet.weights.files import FileWriter

    config = LlamaConfig(**SHAPE)
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in LlamaForCausalLM(config).state_dict().items()}
    directory.mkdir(parents=True, exist_ok=True)
    files: list[list[str]] = [[]]
    size = 0
    for key, (shape, _) in shapes.items():
        nbytes = math.prod(shape) * 4
        if size and size + nbytes > SHARD_BYTES:
            files.append([])
            size = 0
        files[-1].append(key)
        size += nbytes
    weight_map, generator = {}, torch.Generator().manual_seed(0)
    for i, keys in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        writer = FileWriter(directory / name, [(k, torch.float32, shapes[k][0]) for k in keys])
        for key in keys:
            tensor = torch.empty(shapes[key][0])
            tensor.normal_(0.0, 0.02, generator=generator) if tensor.dim() > 1 else tensor.fill_(1.0)
            writer.add(tensor)
            weight_map[key] = name
        writer.close()
    total = sum(math.prod(s) * 4 for s, _ in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(directory)
    return total


def from_pretrained_job(directory: str) -> dict:
    from transformers import AutoModelForCausalLM

    with PeakResident() as memory:
        tick, cpu = time.perf_counter(), cpu_seconds()
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        took, cpu = time.perf_counter() - tick, cpu_seconds() - cpu
    # from_pretrained maps the files and reads a page when a tensor first touches it: read them all, as a first
    # forward would, for the time and memory of weights in memory.
    with PeakResident() as touched, torch.no_grad():
        tick, touch_cpu = time.perf_counter(), cpu_seconds()
        sum(float(p.sum()) for p in model.parameters())
        touch, touch_cpu = time.perf_counter() - tick, cpu_seconds() - touch_cpu
    return {
        "seconds": took,
        "cpu": cpu,
        "growth": memory.growth,
        "touch_seconds": touch,
        "touch_cpu": touch_cpu,
        "touched_growth": touched.growth,
    }


def fleet_job(strategy: str, directory: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchfleet import Fleet

    fleet = Fleet(strategy=strategy)
    config = AutoConfig.from_pretrained(directory)
    config.use_cache = False
    example = {"input_ids": torch.randint(0, SHAPE["vocab_size"], (2, 16))}
    torch.distributed.barrier()
    with PeakResident() as memory:
        tick, cpu = time.perf_counter(), cpu_seconds()
        with fleet.init_module():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fleet.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), example_inputs=example, weights=directory)
        took, cpu = time.perf_counter() - tick, cpu_seconds() - cpu
    report = fleet.weights_report or {}
    mine = [
        t.to_local() if hasattr(t, "to_local") else t
        for m in getattr(fleet.strategy, "stage_modules", None) or [fleet.strategy.unwrapped()]
        for t in m.parameters()
    ]
    # A mapped share is read when first touched, as from_pretrained's weights are: read it all, likewise.
    with PeakResident() as touched, torch.no_grad():
        tick, touch_cpu = time.perf_counter(), cpu_seconds()
        sum(float(t.sum()) for t in mine)
        touch, touch_cpu = time.perf_counter() - tick, cpu_seconds() - touch_cpu
    fleet.close()
    return {
        "seconds": took,
        "cpu": cpu,
        "growth": memory.growth,
        "touch_seconds": touch,
        "touch_cpu": touch_cpu,
        "touched_growth": touched.growth,
        "held": sum(t.nbytes for t in mine),
        "read": report.get("read_bytes"),
        "mapped": report.get("mapped_bytes"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/torchfleet-llama-1b", help="where the model is written (once)")
    parser.add_argument("--cases", default="from_pretrained,fsdp,tp,pipeline")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    from torchfleet import launch

    directory = Path(args.dir)
    if not (directory / "model.safetensors.index.json").is_file():
        print(f"writing the model's random weights to {directory} ...", flush=True)
        write_model(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    model_bytes = index["metadata"]["total_size"]
    print(f"model: {model_bytes / 1e9:.2f} GB fp32 in {len(set(index['weight_map'].values()))} files", flush=True)
    rows = {}
    for case in args.cases.split(","):
        if case == "from_pretrained":
            ranks = launch(from_pretrained_job, nprocs=1, args=(str(directory),))
        else:
            ranks = launch(fleet_job, nprocs=2, args=(case, str(directory)))
        rows[case] = {
            "seconds": max(r["seconds"] for r in ranks),
            "cpu_seconds": max(r["cpu"] for r in ranks),
            "touched_seconds": max(r["seconds"] + r["touch_seconds"] for r in ranks),
            "touched_cpu_seconds": max(r["cpu"] + r["touch_cpu"] for r in ranks),
            "growth_over_model": [round(r["growth"] / model_bytes, 3) for r in ranks],
            "touched_growth_over_model": [round((r["growth"] + r["touched_growth"]) / model_bytes, 3) for r in ranks],
            "held_over_model": [round(r.get("held", model_bytes) / model_bytes, 3) for r in ranks],
            "read_over_model": [round(r.get("read", model_bytes) / model_bytes, 3) for r in ranks],
            "mapped_over_model": [round(r.get("mapped", 0) / model_bytes, 3) for r in ranks],
        }
        print(case, json.dumps(rows[case]), flush=True)
    if "from_pretrained" in rows:
        base = rows["from_pretrained"]
        for row in rows.values():
            row["seconds_over_from_pretrained"] = round(row["seconds"] / base["seconds"], 2)
            row["seconds_over_from_pretrained_touched"] = round(row["seconds"] / base["touched_seconds"], 2)
            row["touched_seconds_over_from_pretrained_touched"] = round(
                row["touched_seconds"] / base["touched_seconds"], 2
            )
            row["cpu_over_from_pretrained_touched"] = round(row["cpu_seconds"] / base["touched_cpu_seconds"], 2)
    print(json.dumps(rows, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model_bytes": model_bytes, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
