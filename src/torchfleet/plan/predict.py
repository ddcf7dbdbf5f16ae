"""Predicted memory per rank and step time for one strategy on one number of processes.

Every multi-process strategy is a preset of four degrees (strategies/dims.py):
replicas r (dp_replicate), shards s (dp_shard), pipeline stages p and
tensor-parallel ranks t. The formulas below are written once over the degrees,
so ddp is (r=N), fsdp (s=N), hsdp (r=2, s=N/2), the pipelines (p, with r or s)
and tp (t), as the strategies themselves are.

Memory per rank (fp32 training, bytes), with P_rank the parameters a rank
holds (the blocks split over p and t; the rest on every stage that needs it),
sharded over s:
    parameters 4 P_rank / s, gradients 4 P_rank / s, optimizer state k P_rank / s
    (k = 8 for AdamW's two moments, 4 for SGD's momentum)
    communication buffers: ddp's gradient buckets (a second copy of the
    gradients, 4 P_rank); fsdp's gathered unit in backward, its parameters and
    its unsharded gradients before their reduce-scatter: 2 x 4 x the largest unit
    activations: the profile's measured line at the rank's batch (a pipeline
    stage holds 1/p of the layers, for the micro-batches in flight: all m
    under GPipe, p under 1F1B)
The step's peak is the larger of its two phases: forward-and-backward
(activations) and the optimizer step (gradients and its temporaries).

Step time = compute + the communication not hidden behind it:
    compute: the profile's measured `fixed + per_sample x batch` at the threads
    each process gets, times the processes per core where they outnumber the
    cores (they take turns); or FLOPs / the device's rate on a described GPU.
    A pipeline runs (m + p - 1) slots of one micro-batch on one stage, m of
    them useful: the bubble is (p - 1) / (m + p - 1) of the step.
    ddp: the bucketed all-reduce overlaps backward where a core or a device is
    free for it, all but the last bucket; fsdp's all-gathers (forward and
    backward) and reduce-scatter overlap compute the same way (prefetch);
    tp: 4 all-reduces of the activations per block, in the critical path.
On CPU targets the strategies' own machinery, measured by this machine's
probes (overheads.py), is added on the critical path as well: FSDP2's cost
per unit and per step (in place of the per-message latency, which its
measurement includes), tp's per parallel Linear, DDP's reducer per gradient
tensor and per step, and a pipeline's per slot (in place of each send's
latency). GPU targets have no such figures: their collectives cost latency
and bytes only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torchfleet.plan.comm import (
    Link,
    all_gather_s,
    all_reduce_s,
    bucketed_all_reduce_s,
    reduce_scatter_s,
    send_s,
)
from torchfleet.plan.hardware import Target
from torchfleet.plan.probe import Calibration
from torchfleet.plan.profile import Profile

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
BACKWARD_SHARE = 2 / 3  # backward is about twice forward's FLOPs
MP_MICROBATCHES = 4  # strategies/mp.py's default
OPTIMIZER_SHARE = 0.2  # of a step's fixed cost, the optimizer's (paid once, however many micro-batches)


@dataclass(frozen=True)
class Layout:
    strategy: str
    processes: int
    replicate: int = 1
    shard: int = 1
    pp: int = 1
    tp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    sync_every: int = 1  # diloco and localsgd: steps between meetings

    @property
    def readers(self) -> int:
        return self.replicate * self.shard

    def degrees(self) -> str:
        """Short: "rep2 x shard2", "pp2 m4" (m: micro-batches), "-" for one process."""
        parts = [f"{k}{v}" for k, v in (("rep", self.replicate), ("shard", self.shard), ("pp", self.pp),
                                        ("tp", self.tp)) if v > 1]
        text = " x ".join(parts)
        if self.pp > 1 or self.strategy == "mp":
            text += f" m{self.microbatches}"
        return text.strip() or "-"


@dataclass
class Prediction:
    strategy: str
    processes: int
    global_batch: int
    degrees: str
    memory: dict  # bytes per rank: parameters, gradients, optimizer, activations, buffers, training_state, peak
    time: dict  # seconds: compute, bubble, communication (exposed), communication_total, step
    fits: bool
    largest_batch: int | None  # the largest global batch that fits, None when none does
    samples_per_s: float
    efficiency: float | None = None  # speedup over serial / processes
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def layout(strategy: str, processes: int, batch: int, profile: Profile, options: dict | None = None,
           cpu_threads: int = 0) -> Layout:
    """The degrees `strategy` runs with; UsageError (from the strategy's own rules) where it cannot."""
    from torchfleet.strategies import resolve_dims

    options = dict(options or {})
    if strategy == "mp":
        return Layout(strategy, 1, microbatches=options.get("microbatches") or MP_MICROBATCHES)
    if strategy in ("diloco", "localsgd"):
        return Layout(strategy, processes, replicate=processes, sync_every=options.get("sync_every") or 100)
    dims = resolve_dims(strategy, processes, options=options)
    if dims is None:
        return Layout(strategy, 1)
    lay = Layout(strategy, processes, dims.dp_replicate, dims.dp_shard, dims.pp, dims.tp,
                 schedule=options.get("schedule") or "1f1b")
    if dims.pp > 1:
        local = max(1, batch // lay.readers)
        m = options.get("microbatches") or _default_microbatches(
            local, dims.pp, lay.schedule, profile.pointwise_convs and cpu_threads == 1)
        lay = Layout(**{**asdict(lay), "microbatches": m})
    return lay


def _default_microbatches(batch: int, stages: int, schedule: str, slow_small_convs: bool) -> int:
    """The pipelines' own rule (strategies/stages.py), restated: the most micro-batches from 2 x stages down
    that divide the batch (1F1B: at least one per stage), keeping 16 samples each where 1x1 convolutions
    on one CPU thread are slow with fewer. --check re-predicts with the count a cell really used."""
    fits = [m for m in range(2 * stages, 0, -1) if batch % m == 0 and (schedule != "1f1b" or m >= stages)]
    if fits and slow_small_convs:
        fits = [m for m in fits if batch // m >= 16] or fits[-1:]
    return fits[0] if fits else 2 * stages


def _rank_parameters(profile: Profile, lay: Layout) -> float:
    rest = profile.parameters - profile.block_parameters
    if lay.pp > 1:
        rest = rest / 2  # embeddings on the first stage, the head on the last
    return profile.block_parameters / (lay.pp * lay.tp) + rest


def memory(profile: Profile, lay: Layout, batch: int) -> dict:
    held = _rank_parameters(profile, lay) / lay.shard
    share = held / profile.parameters
    params, grads, opt = 4 * held, 4 * held, profile.optimizer_bytes(held)
    local = batch / lay.readers
    persistent = 0.0
    gathered = 0.0
    if lay.replicate > 1 and lay.shard == 1 and lay.strategy not in ("diloco", "localsgd"):
        persistent = grads  # DDP's buckets: the gradients once more, for the all-reduce
    if lay.shard > 1:
        gathered = 2 * 4 * min(profile.largest_unit, _rank_parameters(profile, lay))
    if lay.pp > 1:
        micro = local / lay.microbatches
        in_flight = lay.microbatches if lay.schedule == "gpipe" else min(lay.microbatches, lay.pp)
        acts = profile.activation_per_sample * micro * in_flight / lay.pp + 2 * micro * profile.boundary_bytes_per_sample
    elif lay.tp > 1:
        in_blocks = profile.block_parameters / profile.parameters
        acts = profile.activation_per_sample * local * (in_blocks / lay.tp + 1 - in_blocks)
    else:
        acts = profile.activation_per_sample * local
    acts += profile.activation_fixed * share
    forward_backward = acts + gathered
    stepping = grads + profile.optimizer_temporaries * share
    peak = params + opt + persistent + max(forward_backward, stepping)
    return {"parameters": params, "gradients": grads, "optimizer": opt, "activations": acts,
            "buffers": persistent + gathered, "training_state": params + grads + opt, "peak": peak}


def _compute(profile: Profile, lay: Layout, local: float, target: Target, here_cores: int) -> tuple[float, float]:
    """(compute seconds of one rank's step, of which the pipeline bubble)."""
    work_share = 1.0
    if lay.tp > 1:
        in_blocks = profile.block_parameters / profile.parameters
        work_share = in_blocks / lay.tp + 1 - in_blocks
    if target.rate is not None:  # a described GPU: FLOPs at the device's achieved rate
        fixed, per_sample, crowding = 0.0, (profile.flops_per_sample or 0.0) / target.rate, 1.0
    else:
        cores = target.cores_per_node or here_cores
        on_node = min(lay.processes, target.per_node) if not target.here else lay.processes
        threads = max(1, cores // on_node)
        fit = profile.step_fit(min(threads, here_cores))
        fixed, per_sample = fit.fixed_s, fit.per_sample_s
        crowding = max(1.0, on_node * threads / cores)
    if lay.pp > 1:
        micro = local / lay.microbatches
        slot = (fixed * (1 - OPTIMIZER_SHARE) + per_sample * micro) / lay.pp
        slots = lay.microbatches + lay.pp - 1
        opt = fixed * OPTIMIZER_SHARE / lay.pp
        return crowding * (slot * slots + opt), crowding * slot * (lay.pp - 1)
    if lay.strategy == "mp":
        repeats = OPTIMIZER_SHARE + (1 - OPTIMIZER_SHARE) * lay.microbatches
        return crowding * (fixed * repeats + per_sample * local), 0.0
    return crowding * (fixed + per_sample * local * work_share), 0.0


def _links(target: Target, lay: Layout, calib: Calibration | None) -> tuple[Link, Link, Link, Link]:
    """(tp's, shards', replicas', pipeline sends') links: the innermost degrees share a node where they fit."""
    if target.here and calib is not None:
        link = calib.link(lay.processes)
        return link, link, link, calib.p2p_link(lay.processes)
    return (target.link_for(lay.tp), target.link_for(lay.tp * lay.pp * lay.shard), target.link_for(lay.processes),
            target.link_for(lay.pp * lay.tp))


def step_time(profile: Profile, lay: Layout, batch: int, target: Target, here_cores: int,
              calib: Calibration | None) -> dict:
    """Seconds per step and its parts; `calib`: this machine's probed links (for a target that is here)."""
    local = batch / lay.readers
    compute, bubble = _compute(profile, lay, local, target, here_cores)
    tp_link, shard_link, replica_link, p2p_link = _links(target, lay, calib)
    # Where the processes leave no core free, a CPU cannot copy one bucket while it computes the next.
    overlap = 1.0 if target.rate is not None else (0.0 if _cores_busy(lay, target, here_cores) else 1.0)
    stage_bytes = 4 * _rank_parameters(profile, lay)
    backward = BACKWARD_SHARE * (compute - bubble)
    costs = _overheads(target, lay, calib)
    per_stage = 1 / lay.pp  # a pipeline stage holds its share of the units and tensors
    total = exposed = 0.0
    if lay.strategy in ("diloco", "localsgd"):
        total = exposed = all_reduce_s(4 * profile.parameters, lay.replicate, replica_link) / lay.sync_every
    elif lay.replicate > 1:
        grads = stage_bytes / lay.shard
        if lay.shard == 1 and lay.strategy != "hsdp":
            whole, last = bucketed_all_reduce_s(grads, lay.replicate, replica_link, DDP_BUCKET_BYTES)
            # the reducer's own work (hooks, copies into buckets) runs on the cores backward needs
            reducer = costs.get("ddp_step_s", 0.0) + costs.get("ddp_tensor_s", 0.0) * profile.tensors * per_stage
            total, exposed = whole + reducer, max(last, whole - overlap * backward) + reducer
        else:  # hsdp: the shards' gradients, all-reduced across replicas after their reduce-scatter
            total = exposed = all_reduce_s(grads, lay.replicate, replica_link)
    if lay.shard > 1 or lay.strategy == "hsdp":
        units = max(1, profile.units)
        gathers = 2 * all_gather_s(stage_bytes, lay.shard, shard_link)
        scatter = reduce_scatter_s(stage_bytes, lay.shard, shard_link)
        if costs:  # measured: FSDP2's work around each unit's collectives, their small-message latency in it
            machinery = costs["fsdp_step_s"] + costs["fsdp_unit_s"] * max(1.0, units * per_stage)
        else:
            machinery = 3 * (units - 1) * (lay.shard - 1) * shard_link.latency
        fsdp = gathers + scatter + machinery
        first_and_last = (gathers / 2 + scatter) / units  # the first gather and the last scatter wait on nothing
        total += fsdp
        # The bytes can hide behind compute where a core is free (prefetch); measured machinery is CPU work
        # on the critical path, the latency of the unmeasured case travels with the bytes.
        hideable = gathers + scatter + (0.0 if costs else machinery)
        exposed += max(first_and_last, hideable - overlap * (compute - bubble)) + (machinery if costs else 0.0)
    if lay.tp > 1:
        blocks = max(1, profile.units - 1)
        tp = 4 * blocks * all_reduce_s(local * profile.boundary_bytes_per_sample, lay.tp, tp_link)
        if costs:  # measured: the DTensor conversions and collectives around each parallel Linear
            tp += costs["tp_step_s"] + costs["tp_linear_s"] * (profile.tp_linears or 6 * blocks) / lay.pp
        total += tp
        exposed += tp
    if lay.pp > 1:
        micro = local / lay.microbatches
        slots = lay.microbatches + lay.pp - 1
        if costs:  # measured: a slot's sends, receives and schedule work beyond its arithmetic; then the bytes
            p2p = slots * (costs["pipeline_slot_s"] + 2 * micro * profile.boundary_bytes_per_sample / p2p_link.bandwidth)
        else:
            p2p = 2 * slots * send_s(micro * profile.boundary_bytes_per_sample, p2p_link)
        total += p2p
        exposed += p2p
    step = compute + exposed
    return {"compute": compute, "bubble": bubble, "communication": exposed, "communication_total": total,
            "step": step}


def _overheads(target: Target, lay: Layout, calib: Calibration | None) -> dict[str, float]:
    """The strategies' measured per-step overheads (overheads.py) that apply: this machine's at the plan's
    process count; a described CPU cluster's at a process per core (2 here); none on GPUs, whose collectives
    and kernels these CPU figures do not describe."""
    if calib is None or target.rate is not None or lay.processes < 2:
        return {}
    return calib.overhead(lay.processes if target.here else 2)


def _cores_busy(lay: Layout, target: Target, here_cores: int) -> bool:
    cores = target.cores_per_node or here_cores
    on_node = lay.processes if target.here else min(lay.processes, target.per_node)
    return on_node * max(1, cores // on_node) >= cores


def fits(peak: float, lay: Layout, target: Target) -> bool:
    """A GPU holds one rank; a CPU host's memory holds all of its ranks."""
    if target.rate is not None:
        return peak <= target.memory_bytes
    on_node = lay.processes if target.here else min(lay.processes, target.per_node)
    return peak * on_node <= target.memory_bytes


def largest_batch(profile: Profile, lay: Layout, target: Target) -> int | None:
    """The largest global batch (a multiple of the readers and micro-batches) whose peak fits."""
    unit = lay.readers * max(1, lay.microbatches if lay.pp > 1 else 1)
    if not fits(memory(profile, lay, unit)["peak"], lay, target):
        return None
    low, high = 1, 2
    while fits(memory(profile, lay, unit * high)["peak"], lay, target) and high < 2**40:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(memory(profile, lay, unit * mid)["peak"], lay, target) else (low, mid)
    return unit * low


def predict(profile: Profile, lay: Layout, batch: int, target: Target, here_cores: int,
            calib: Calibration | None) -> Prediction:
    mem = memory(profile, lay, batch)
    times = step_time(profile, lay, batch, target, here_cores, calib)
    return Prediction(lay.strategy, lay.processes, batch, lay.degrees(), mem, times,
                      fits(mem["peak"], lay, target), largest_batch(profile, lay, target),
                      batch / times["step"] if times["step"] > 0 else 0.0)
