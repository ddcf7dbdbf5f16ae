"""`torchfleet plan` from config to document: target, profile, predictions, recommendation, and the check."""

from __future__ import annotations

import datetime

from torchfleet.errors import UsageError
from torchfleet.plan import check as plan_check
from torchfleet.plan import contention, hardware, layout_trace, layouts, predict, probe
from torchfleet.plan.config import PlanConfig
from torchfleet.plan.profile import Profile
from torchfleet.plan.profiler import meminfo
from torchfleet.strategies import registry

SCHEMA = "torchfleet-plan/1"
# The costs predict.py models on a described cluster (registry.Preset.cost): hogwild and mp are
# one-machine strategies, dp one process over a machine's GPUs: planned here only.
CLUSTER_COSTS = ("one", "mesh", "meetings")


def _host_memory() -> float:
    return meminfo("MemTotal") or 16e9


def target_of(cfg: PlanConfig, calib: probe.Calibration | None) -> hardware.Target:
    if cfg.gpus_per_node is not None or cfg.gpu is not None or cfg.tflops is not None:
        return hardware.gpu_cluster(
            nodes=cfg.nodes or 1,
            per_node=cfg.gpus_per_node or 1,
            gpu=cfg.gpu,
            tflops=cfg.tflops,
            memory_gb=cfg.memory_gb,
            mfu=cfg.mfu,
            precision=cfg.precision,
            intra_gbit=cfg.intra_gbit,
            inter_gbit=cfg.link_gbit,
        )
    assert calib is not None
    if cfg.described:
        intra = calib.link(2) if cfg.intra_gbit is None else predict.Link(cfg.intra_gbit * 1e9 / 8, 50e-6)
        return hardware.cpu_cluster(
            nodes=cfg.nodes or 1,
            cores_per_node=cfg.cpus_per_node or calib.cores,
            memory_gb=cfg.memory_gb or _host_memory() / 1e9,
            intra=intra,
            inter_gbit=cfg.link_gbit,
        )
    counts = cfg.nproc or (1, 2, 4)
    memory = cfg.memory_gb * 1e9 if cfg.memory_gb else _host_memory()
    return hardware.Target(
        f"this machine ({calib.cores} cores, Gloo)",
        1,
        max(counts),
        memory,
        calib.link(2),
        calib.link(2),
        cores_per_node=0,
        here=True,
    )


def spec_of(cfg: PlanConfig) -> dict:
    """bench's spec keys for its workload (bench/measure_cell.py)."""
    from torchfleet.models import TOKEN_MODELS, gpt_config

    spec = {
        "model": cfg.model,
        "gpt_preset": cfg.gpt_preset,
        "image_size": cfg.image_size,
        "seed": cfg.seed,
        "precision": cfg.precision,
    }
    if cfg.model in TOKEN_MODELS:
        spec["block_size"] = gpt_config(cfg.gpt_preset).block_size
    return spec


def default_batch(cfg: PlanConfig, gpus: bool) -> int:
    from torchfleet.bench.cells import _default_batches

    return _default_batches(cfg.model, 1 if gpus else 0)[0]


def candidates(cfg: PlanConfig, target: hardware.Target, profile: Profile, cores: int) -> list[tuple[str, int]]:
    """(strategy, processes) pairs to plan: bench's cells here, every preset's degrees on a described cluster."""
    if target.here:
        from torchfleet.backend import probe_hardware
        from torchfleet.bench.cells import plan as bench_plan
        from torchfleet.bench.config import BenchConfig
        from torchfleet.doctor import strategy_availability

        counts = tuple(n for n in (cfg.nproc or (1, 2, 4)) if n >= 2) or (2,)
        bench = BenchConfig(
            model=cfg.model,
            gpt_preset=cfg.gpt_preset,
            image_size=cfg.image_size,
            strategies=cfg.strategies,
            nproc=counts,
            batch_sizes=(cfg.batch or 1,),
            precisions=("fp32",),
        )
        cells, _ = bench_plan(bench, strategy_availability(probe_hardware(), cores), cores, hogwild=True)
        pairs = dict.fromkeys((c.strategy, c.processes) for c in cells if not c.skip)
        return [(name, n) for name, n in pairs if name in cfg.strategies or applies(name, profile)]
    presets = registry.presets()
    names = cfg.strategies or tuple(
        n
        for n, p in presets.items()
        if p.cost in CLUSTER_COSTS and (not p.splits_layers or profile_tp(profile)) and applies(n, profile)
    )
    counts = cluster_counts(cfg, target)
    pairs = []
    for name in names:
        for n in counts:
            if presets[name].cost == "meetings" and target.nodes < 2:
                continue
            if (presets[name].cost == "one") == (n == 1):
                pairs.append((name, n))
    return pairs


def cluster_counts(cfg: PlanConfig, target: hardware.Target) -> tuple[int, ...]:
    """The process counts planned on a described cluster: --nproc, else the powers of 2 up to its devices."""
    return cfg.nproc or tuple(
        sorted({2**k for k in range(target.devices.bit_length()) if 2**k <= target.devices} | {target.devices})
    )


def pipeline_options(cfg: PlanConfig) -> dict:
    """--schedule and --stages-per-process as the pipelines take them (the other strategies take neither)."""
    return {
        k: v for k, v in (("schedule", cfg.schedule), ("stages_per_process", cfg.stages_per_process)) if v is not None
    }


def profile_tp(profile: Profile) -> bool:
    from torchfleet.models import TOKEN_MODELS

    return profile.model in TOKEN_MODELS  # the built-in gpt and gpt-moe ship a tensor-parallel plan


def applies(strategy: str, profile: Profile) -> bool:
    """Whether the default plan includes `strategy` for this model: expert parallelism only where it has experts
    (as tp only where it has a plan); asked for by name, a strategy is planned or left out with its reason."""
    return not registry.presets()[strategy].splits_experts or profile.experts > 0


def ep_problem(lay: layouts.Layout, profile: Profile) -> str | None:
    """Why expert parallelism cannot split this model's experts (strategies/expert_parallel.py's rule), or None."""
    if lay.ep == 1:
        return None
    if not profile.experts:
        return (
            f"{profile.model} has no experts to split (no module whose weights stack one matrix per expert);"
            " plan ep with a mixture-of-experts model"
        )
    if profile.experts % lay.ep:
        return f"ep {lay.ep} does not divide the model's {profile.experts} experts a layer"
    return None


def predictions(
    cfg: PlanConfig, target: hardware.Target, profile: Profile, calib, cores: int, batch: int
) -> tuple[list[predict.Prediction], list[str]]:
    notes, found = [], []
    options = pipeline_options(cfg)
    for name, n in candidates(cfg, target, profile, cores):
        threads = max(1, cores // n)
        try:
            lay = layouts.layout(name, n, batch, profile, options, cpu_threads=threads)
        except UsageError as exc:
            notes.append(f"{name} on {n} processes left out: {exc}")
            continue
        problem = ep_problem(lay, profile)
        if problem:
            notes.append(f"{name} on {n} processes left out: {problem}")
            continue
        if batch % lay.readers or (lay.pp > 1 and (batch // lay.readers) % lay.microbatches):
            notes.append(
                f"{name} on {n} processes left out: the batch of {batch} does not split into"
                f" {lay.readers} readers x {lay.microbatches if lay.pp > 1 else 1} micro-batches"
            )
            continue
        prediction = predict.predict(profile, lay, batch, target, cores, calib)
        if target.here and registry.traced(name):  # runs here: its memory traced, not estimated
            try:
                traced_memory(cfg, profile.optimizer, lay, prediction, target)
            except UsageError as exc:  # the strategy cannot split this model (tp without a plan)
                notes.append(f"{name} on {n} processes left out: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 (an operator without a fake kernel: the formulas stand)
                why = plan_check.first_line(exc)
                notes.append(f"{name} on {n} processes: memory from the profile's formulas, not traced ({why})")
        found.append(prediction)
    serial = next((p for p in found if p.strategy == registry.REFERENCE), None)
    for p in found:
        if serial is not None and p.time["step"] > 0:
            p.efficiency = serial.time["step"] / p.time["step"] / max(1, p.processes)
    return found, notes


def traced_memory(cfg: PlanConfig, optimizer: str, lay: layouts.Layout, p: predict.Prediction, target) -> None:
    """`p`'s memory from `lay` traced here (layout_trace.py), in place of the formulas'."""
    options = {}
    if lay.pp > 1:  # the schedule and micro-batches the plan modelled, not the count a rank's threads would pick
        options = {"schedule": lay.schedule, "microbatches": lay.microbatches}
        options.update({"stages_per_process": lay.stages_per_process} if lay.stages_per_process > 1 else {})
    peak = layout_trace.traced_peak(spec_of(cfg), optimizer, lay.strategy, p.processes, p.global_batch, options)
    # The safe figure decides: a step that frees a collective's buffer late holds it.
    p.memory["peak"] = peak.late
    p.memory["peak_freed_promptly"] = peak.prompt
    p.fits = predict.fits(peak.late, lay, target)


def recommend(found: list[predict.Prediction], cpus: bool = True) -> dict:
    """The fastest strategy that fits, and one sentence per strategy on where it stands (`cpus`: its
    processes run on CPU cores, which several may share; GPUs are one a process)."""
    fitting = [p for p in found if p.fits]
    if not fitting:
        return {"best": None, "sentences": {}}
    best = max(fitting, key=lambda p: p.samples_per_s)
    sentences = {}
    for name in dict.fromkeys(p.strategy for p in found):
        mine = [p for p in found if p.strategy == name]
        fit = [p for p in mine if p.fits]
        if not fit:
            smallest = min(mine, key=lambda p: p.memory["peak"])
            sentences[name] = (
                f"{name}: does not fit: {_gib(smallest.memory['peak'])} per rank at best"
                f" ({smallest.processes} processes)"
            )
            continue
        top = max(fit, key=lambda p: p.samples_per_s)
        where = f"{name} on {top.processes} process{'es' if top.processes > 1 else ''}" + (
            f" ({top.degrees})" if top.degrees != "-" else ""
        )
        if top is best:
            sentences[name] = (
                f"{where}: the fastest that fits, {top.samples_per_s:,.1f} samples/s,"
                f" {_gib(top.memory['peak'])} per rank{_scaling(top)}"
            )
            continue
        slower = 1 - top.samples_per_s / best.samples_per_s
        sentences[name] = f"{where}: {slower:.0%} slower than {best.strategy}: {_why(top, cpus)}"
    return {
        "best": {"strategy": best.strategy, "processes": best.processes, "samples_per_s": best.samples_per_s},
        "sentences": sentences,
    }


def _scaling(p: predict.Prediction) -> str:
    return "" if p.efficiency is None or p.processes == 1 else f", scaling efficiency {p.efficiency:.0%}"


def _why(p: predict.Prediction, cpus: bool) -> str:
    t = p.time
    parts = {
        "communication": t["communication"],
        "the pipeline bubble": t["bubble"],
        "compute": t["compute"] - t["bubble"],
    }
    name, seconds = max(parts.items(), key=lambda kv: kv[1])
    share = seconds / t["step"] if t["step"] else 0
    if name == "compute":
        return (
            f"its compute does not shrink enough ({share:.0%} of a {t['step'] * 1e3:,.1f} ms step"
            f"{'; its processes share the cores' if cpus and p.processes > 1 else ''})"
        )
    return f"{name} is {share:.0%} of its {t['step'] * 1e3:,.1f} ms step"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:,.1f} MiB"


def plan_document(cfg: PlanConfig, say=print) -> dict:
    from torchfleet.models import TOKEN_MODELS
    from torchfleet.plan import profiler

    needs_here = cfg.check or not (cfg.gpus_per_node or cfg.gpu or cfg.tflops)
    links = tuple(sorted({n for n in (cfg.nproc or (1, 2, 4)) if n >= 2} or {2}))
    calib = probe.calibration(cfg.reprobe, say=say, processes=links) if needs_here else None
    cores = calib.cores if calib is not None else probe.usable_cores()
    target = target_of(cfg, calib)
    batch = cfg.batch or default_batch(cfg, target.rate is not None)
    optimizer = "sgd" if cfg.check else cfg.optimizer  # the check runs bench's cells, with bench's optimizer
    say(
        f"profiling {cfg.model} (a few steps at a few batches, to measure its memory"
        + (" and time)" if target.rate is None else ")")
    )
    # Timed at the local batches the planned processes run (the global batch split among them): here, 1 to
    # the most processes planned; on a described CPU cluster, whose compute is this machine's step, its own
    # counts. A line through the probe's own batches, drawn instead, overpriced the step at the batches
    # that run, and with it whole plans (docs/benchmarks/history.md, "Two machines on a slow link").
    counts = links if target.here else cluster_counts(cfg, target) if target.rate is None else ()
    local = tuple(max(1, batch // n) for n in (1, *counts)) if counts else ()
    profile = profiler.measure(spec_of(cfg), optimizer, cores, timed=target.rate is None, time_at=local)
    if target.here:
        contention.measure_missing(calib, profile, spec_of(cfg), batch, links, say=say)
    found, notes = predictions(cfg, target, profile, calib, cores, batch)
    if not found:
        raise UsageError(
            f"no strategy can be planned for a global batch of {batch} on {target.name}; "
            + ("; ".join(notes) or "give other --nproc or --strategies")
        )
    if not any(p.fits for p in found) and not cfg.check:
        smallest = min(found, key=lambda p: p.memory["peak"])
        raise UsageError(
            f"a global batch of {batch} fits no strategy on {target.name}: the smallest peak is"
            f" {_gib(smallest.memory['peak'])} per rank ({smallest.strategy} on {smallest.processes}"
            f" processes) against {_gib(target.memory_bytes)}; give a smaller --batch-size or more"
            " devices"
        )
    if optimizer != cfg.optimizer:
        notes.append(f"--check plans for bench's optimizer (SGD with momentum), not {cfg.optimizer}")
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": cfg.model,
        "gpt_preset": cfg.gpt_preset if cfg.model in TOKEN_MODELS else None,
        "image_size": cfg.image_size,
        "global_batch": batch,
        "optimizer": optimizer,
        "precision": cfg.precision,
        "target": target.as_dict(),
        "calibration": calib.as_dict() if calib is not None else None,
        "profile": profile.as_dict(),
        "predictions": [p.as_dict() for p in found],
        "recommendation": recommend(found, cpus=target.rate is None),
        "notes": notes,
        "_found": found,
        "_profile": profile,
        "_target": target,
        "_calibration": calib,
        "_config": cfg,
    }


def run_check(cfg: PlanConfig, document: dict, say=print) -> dict:
    """bench's cells here, each predicted and measured; the rows and their summary."""
    from torchfleet import machine_load
    from torchfleet.backend import probe_hardware
    from torchfleet.bench.cells import Cell

    spec = {**spec_of(cfg), "precision": "fp32", "warmup": cfg.warmup, "steps": cfg.steps, "options": {}}
    rows = []
    cores = document["calibration"]["cores"]
    gpus = probe_hardware().gpus  # the cells run here, on these
    state = machine_load.measure(gpus=gpus)
    say(("warning: " if state.busy else "") + state.line())
    for p in document["_found"]:
        cell = Cell(p.strategy, p.processes, p.global_batch, "fp32", max(1, cores // p.processes))
        piped = " m" in p.degrees and p.processes > 1  # a pipeline: it runs the schedule planned
        measured = plan_check.run_cell(
            cell, {**spec, "options": pipeline_options(cfg) if piped else {}}, cfg.cell_timeout_s
        )
        used = measured.get("microbatches")
        if used and piped and f" m{used} " not in f"{p.degrees} ":
            p = _repredicted(document, p, used)  # the schedule chose another count than the plan's rule
        rows.append(plan_check.compare(p, measured))
    # Flagged against the serial cell, which may come last: the lines follow once every cell has run.
    plan_check.flag(rows, cores, gpus)
    for row in rows:
        say(_check_line(row))
    return {"cells": rows, "summary": plan_check.summary(rows), "machine_state": state.row()}


def _repredicted(document: dict, p: predict.Prediction, microbatches: int) -> predict.Prediction:
    profile, target, calib = document["_profile"], document["_target"], document["_calibration"]
    lay = layouts.layout(
        p.strategy,
        p.processes,
        p.global_batch,
        profile,
        {**pipeline_options(document["_config"]), "microbatches": microbatches},
    )
    again = predict.predict(profile, lay, p.global_batch, target, calib.cores, calib)
    if "peak_freed_promptly" in p.memory:  # traced before: traced again with this count
        traced_memory(document["_config"], profile.optimizer, lay, again, target)
    return again


def _check_line(row: dict) -> str:
    name = f"{row['strategy']} x{row['processes']}, batch {row['global_batch']}"
    if row["status"] != "ok":
        return f"{name}: failed ({row['error']})"
    text = (
        f"{name}: step predicted {row['predicted_step_s'] * 1e3:,.1f} ms, measured"
        f" {row['measured_step_s'] * 1e3:,.1f} ms"
    )
    if row["measured_peak_bytes"] is not None:
        text += f"; peak predicted {_gib(row['predicted_peak_bytes'])}, measured {_gib(row['measured_peak_bytes'])}"
    if row["flag_reasons"]:
        text += f"; flagged: {'; '.join(row['flag_reasons'])}"
    return text
