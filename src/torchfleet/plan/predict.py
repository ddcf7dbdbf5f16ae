"""Predicted memory per rank and step time for one strategy on one number of processes.

Every multi-process strategy is a preset of four degrees (strategies/dims.py;
plan/layouts.py reads them for a strategy): replicas r (dp_replicate), shards
s (dp_shard), pipeline stages p and tensor-parallel ranks t. The formulas
below are written once over the degrees, so ddp is (r=N), fsdp (s=N), hsdp
(r=2, s=N/2), the pipelines (p, with r or s) and tp (t), as the strategies
themselves are.

Memory per rank (fp32 training, bytes), with P_rank the parameters a rank
holds (the blocks split over p and t; the rest on every stage that needs it),
sharded over s:
    parameters 4 P_rank / s, gradients 4 P_rank / s, optimizer state k P_rank / s
    (k = 8 for AdamW's two moments, 4 for SGD's momentum)
    communication buffers: ddp's gradient buckets (a second copy of the
    gradients, 4 P_rank); fsdp's gathered unit in backward, its parameters and
    its unsharded gradients before their reduce-scatter: 2 x 4 x the largest unit
    activations: the profile's measured line at the rank's batch (a pipeline
    stage holds its share of the layers for the micro-batches in flight, per
    schedule: pipelines.py)
The step's peak is the larger of its two phases: forward-and-backward
(activations) and the optimizer step (gradients and its temporaries).

Step time = compute + the communication not hidden behind it:
    compute: the profile's measured `fixed + per_sample x batch` at the threads
    each process gets, times how much slower the same step runs in every
    process at once than alone (this machine's contention probe, contention.py;
    the processes per core where it is not measured); or FLOPs / the device's
    rate on a described GPU. The optimizer's step (timed alone) is paid once a
    step; the rest of `fixed` once per micro-batch (mp, the pipelines).
    A pipeline runs the busy and idle slots of its schedule (pipelines.py:
    (p - 1) / (m + p - 1) of the step idle under GPipe and 1F1B, less with
    several stages per process or zero bubble).
    ddp: the bucketed all-reduce overlaps backward where a core or a device is
    free for it, all but the last bucket; fsdp's all-gathers (forward and
    backward) and reduce-scatter overlap compute the same way (prefetch);
    between GPUs what they hide behind runs slower for it (plan/overlap.py),
    which their exposed seconds include;
    tp: 4 all-reduces of the activations per block, in the critical path;
    ep and fsdp+ep (plan/experts.py): the experts' state over ep (fsdp+ep: over
    the shards), the rest as FSDP2 holds it (replicated under ep, sharded under
    fsdp+ep); a step's all-to-alls of the routed rows, in the critical path,
    on the link sends take.
On CPU targets the strategies' own machinery, measured by this machine's
probes (overheads.py), is added on the critical path as well: FSDP2's cost
per unit and per step (in place of the per-message latency, which its
measurement includes), tp's per parallel Linear, DDP's reducer per gradient
tensor and per step, and a pipeline's per slot (in place of each send's
latency). GPU targets have no such figures: their collectives are NCCL's
(plan/nccl.py: ring or tree by size and scale, each with its latency over the
nodes the group spans), DDP's in its buckets (1 MiB first, then 25 MiB), FSDP's
a call per unit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torchfleet.plan import contention, experts, pipelines
from torchfleet.plan.comm import Link, all_gather_s, all_reduce_s, bucketed_all_reduce_s, reduce_scatter_s, send_s
from torchfleet.plan.hardware import Target
from torchfleet.plan.layouts import Layout
from torchfleet.plan.overheads import PAIRS
from torchfleet.plan.overlap import slowed_s
from torchfleet.plan.probe import Calibration
from torchfleet.plan.profile import Profile

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 2**20  # and its first bucket's (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
BACKWARD_SHARE = 2 / 3  # backward is about twice forward's FLOPs
OPTIMIZER_SHARE = 0.2  # of a step's fixed cost, the optimizer's, where a profile has no measured figure


@dataclass
class Prediction:
    strategy: str
    processes: int
    global_batch: int
    degrees: str
    memory: dict  # bytes per rank: parameters, gradients, optimizer, activations, buffers, training_state, peak
    time: dict  # seconds: compute, bubble, communication (exposed, the overlap's slowdown in it), communication_total, step
    fits: bool
    largest_batch: int | None  # the largest global batch that fits, None when none does
    samples_per_s: float
    efficiency: float | None = None  # speedup over serial / processes
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _rank_parameters(profile: Profile, lay: Layout) -> float:
    rest = profile.parameters - profile.block_parameters
    if lay.pp > 1:
        rest = rest / 2  # embeddings on the first stage, the head on the last
    return (profile.tp_split_parameters / lay.tp + profile.tp_whole_parameters) / lay.pp + rest


def _held(profile: Profile, lay: Layout) -> float:
    """Parameters a rank holds: its stage's and tensor-parallel share over the shards, the experts over ep."""
    if lay.ep > 1:
        return experts.held(profile.parameters, profile.expert_parameters, lay.shard, lay.ep)
    return _rank_parameters(profile, lay) / lay.shard


def _largest_unit(profile: Profile, lay: Layout) -> float:
    """Parameters of the largest unit FSDP2 gathers at once: under ep a block's experts are ep's share of them."""
    unit = min(profile.largest_unit, _rank_parameters(profile, lay))
    if lay.ep > 1 and profile.expert_layers:
        unit -= profile.expert_parameters / profile.expert_layers * (1 - 1 / lay.ep)
    return max(0.0, unit)


def memory(profile: Profile, lay: Layout, batch: int) -> dict:
    held = _held(profile, lay)
    share = held / profile.parameters
    params, grads, opt = 4 * held, 4 * held, profile.optimizer_bytes(held)
    # The experts' part of that state: split over ep (over the shards where those are more), else as the rest
    expert_held = profile.expert_parameters * (1 / max(lay.ep, lay.shard) if lay.ep > 1 else share)
    local = batch / lay.readers
    persistent = 0.0
    gathered = 0.0
    if lay.replicate > 1 and lay.shard == 1 and lay.cost != "meetings" and lay.ep == 1:
        persistent = grads  # DDP's buckets: the gradients once more, for the all-reduce (ep replicates by FSDP2)
    if lay.shard > 1:
        gathered = 2 * 4 * _largest_unit(profile, lay)
    # The whole model on the rank, unsplit, at a local batch the profile measured: its peak is read there.
    whole = share == 1 and lay.tp == 1 and lay.pp == 1 and batch % lay.readers == 0
    measured = profile.peak_above_state.get(batch // lay.readers) if whole else None
    if measured is not None:
        acts = measured
    elif lay.pp > 1:
        micro = local / lay.microbatches
        held = pipelines.activations_held(lay.schedule, lay.pp, lay.microbatches, lay.stages_per_process)
        acts = profile.activation_per_sample * micro * held + 2 * micro * profile.boundary_bytes_per_sample
    elif lay.tp > 1:
        in_blocks = profile.tp_split_parameters / profile.parameters
        acts = profile.activation_per_sample * local * (in_blocks / lay.tp + 1 - in_blocks)
    else:
        acts = profile.activation_per_sample * local
    if measured is None:
        acts += profile.activation_fixed * share
    forward_backward = acts + gathered
    stepping = grads + profile.optimizer_temporaries * share
    peak = params + opt + persistent + max(forward_backward, stepping)
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": opt,
        "activations": acts,
        "buffers": persistent + gathered,
        "training_state": params + grads + opt,
        "experts": 8 * expert_held + profile.optimizer_bytes(expert_held),  # of the training state
        "peak": peak,
    }


def _compute(
    profile: Profile, lay: Layout, global_batch: int, target: Target, here_cores: int, calib: Calibration | None = None
) -> tuple[float, float]:
    """(compute seconds of one rank's step, of which the pipeline bubble)."""
    local = global_batch / lay.readers
    work_share = 1.0
    if lay.tp > 1:
        in_blocks = profile.tp_split_parameters / profile.parameters
        work_share = in_blocks / lay.tp + 1 - in_blocks
    if target.rate is not None:  # a described GPU: FLOPs at the device's achieved rate
        fixed, per_sample, crowding, opt = 0.0, (profile.flops_per_sample or 0.0) / target.rate, 1.0, 0.0
    else:
        cores = target.cores_per_node or here_cores
        on_node = min(lay.processes, target.per_node) if not target.here else lay.processes
        threads = min(max(1, cores // on_node), here_cores)
        fit = profile.step_fit(threads)
        fixed, per_sample = fit.fixed_s, fit.per_sample_s
        # The optimizer's step, measured alone, is paid once a step however many micro-batches run.
        opt = min(fixed, profile.optimizer_time(threads, fixed * OPTIMIZER_SHARE))
        crowding = max(1.0, on_node * threads / cores)
        measured = (
            calib.contention(contention.key(profile.workload, global_batch, lay.processes), lay.processes)
            if calib is not None and target.here
            else None
        )
        if measured is not None and lay.processes > 1:
            # the same step run in every process at once, against alone: cores and memory bandwidth shared
            crowding = measured
    fb = fixed - opt  # the batch-independent cost of a forward and backward: paid per micro-batch
    if lay.pp > 1:
        micro = local / lay.microbatches
        busy, idle = pipelines.bubble_slots(lay.schedule, lay.pp, lay.microbatches, lay.stages_per_process)
        slot = (fb + per_sample * micro) / (lay.pp * lay.stages_per_process)  # a stage: 1/(p v) of the model
        return crowding * (slot * (busy + idle) + opt / lay.pp), crowding * slot * idle
    if lay.cost == "stages here":
        return crowding * (fb * lay.microbatches + per_sample * local + opt), 0.0
    return crowding * (fixed + per_sample * local * work_share), 0.0


def _links(target: Target, lay: Layout, calib: Calibration | None) -> tuple[Link, Link, Link, Link]:
    """(tp's, shards', replicas', pipeline sends') links: the innermost degrees share a node where they fit."""
    if target.here and calib is not None:
        link = calib.link(lay.processes)
        return link, link, link, calib.p2p_link(lay.processes)
    return (
        target.link_for(lay.tp),
        target.link_for(lay.tp * lay.pp * lay.shard),
        target.link_for(lay.processes),
        target.link_for(lay.pp * lay.tp),
    )


def step_time(
    profile: Profile, lay: Layout, batch: int, target: Target, here_cores: int, calib: Calibration | None
) -> dict:
    """Seconds per step and its parts; `calib`: this machine's probed links (for a target that is here)."""
    local = batch / lay.readers
    compute, bubble = _compute(profile, lay, batch, target, here_cores, calib)
    tp_link, shard_link, replica_link, p2p_link = _links(target, lay, calib)
    # Where the processes leave no core free, a CPU cannot copy one bucket while it computes the next.
    overlap = 1.0 if target.rate is not None else (0.0 if _cores_busy(lay, target, here_cores) else 1.0)
    stage_bytes = 4 * _rank_parameters(profile, lay)
    backward = BACKWARD_SHARE * (compute - bubble)
    costs = _overheads(target, lay, calib)
    per_stage = 1 / lay.pp  # a pipeline stage holds its share of the units and tensors
    total = exposed = hidden = 0.0
    if lay.cost == "meetings":
        total = exposed = all_reduce_s(4 * profile.parameters, lay.replicate, replica_link) / lay.sync_every
    elif lay.replicate > 1:
        # ep's replicas hold other experts each (ep is every replica): only the rest's gradients are averaged
        grads = (stage_bytes if lay.ep == 1 else 4 * (profile.parameters - profile.expert_parameters)) / lay.shard
        if lay.shard == 1 and not lay.hybrid and lay.ep == 1:
            whole, last = bucketed_all_reduce_s(
                grads, lay.replicate, replica_link, DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
            )
            # the reducer's own work (hooks, copies into buckets) runs on the cores backward needs
            reducer = costs.get("ddp_step_s", 0.0) + costs.get("ddp_tensor_s", 0.0) * profile.tensors * per_stage
            total, exposed = whole + reducer, max(last, whole - overlap * backward) + reducer
            hidden = whole + reducer - exposed
        else:  # hsdp, ep: the shards' gradients, all-reduced across replicas (after their reduce-scatter)
            total = exposed = all_reduce_s(grads, lay.replicate, replica_link)
    if lay.shard > 1 or lay.hybrid or lay.ep > 1:
        units = max(1, profile.units + (profile.expert_layers if lay.ep > 1 else 0))  # the experts: units of their own
        gathers = scatter = 0.0
        # Between GPUs each unit is its own NCCL call, whose latency its algorithm sets (plan/nccl.py).
        per_unit = bool(shard_link.hw) and not costs
        for nbytes, ranks, calls in _sharded(profile, lay, stage_bytes, max(1, round(profile.units * per_stage))):
            calls = calls if per_unit else 1
            gathers += 2 * calls * all_gather_s(nbytes / calls, ranks, shard_link)
            scatter += calls * reduce_scatter_s(nbytes / calls, ranks, shard_link)
        if costs:  # measured: FSDP2's work around each unit's collectives, their small-message latency in it
            machinery = costs["fsdp_step_s"] + costs["fsdp_unit_s"] * max(1.0, units * per_stage)
        elif per_unit:
            machinery = 0.0
        else:
            machinery = 3 * (units - 1) * (lay.shard - 1) * shard_link.latency
        fsdp = gathers + scatter + machinery
        first_and_last = (gathers / 2 + scatter) / units  # the first gather and the last scatter wait on nothing
        total += fsdp
        # The bytes can hide behind compute where a core is free (prefetch); measured machinery is CPU work
        # on the critical path, the latency of the unmeasured case travels with the bytes.
        hideable = gathers + scatter + (0.0 if costs else machinery)
        waits = max(first_and_last, hideable - overlap * (compute - bubble))
        exposed += waits + (machinery if costs else 0.0)
        hidden += hideable - waits
    if lay.ep > 1:
        ep_link = calib.p2p_link(lay.processes) if target.here and calib is not None else target.link_for(lay.ep)
        routed = local * profile.routed_bytes_per_sample
        moved = experts.step_all_to_all_s(routed, profile.experts, profile.expert_layers, lay.ep, ep_link)
        total += moved
        exposed += moved
    if lay.tp > 1:
        blocks = max(1, profile.units - 1)
        tp = 4 * blocks * all_reduce_s(local * profile.boundary_bytes_per_sample, lay.tp, tp_link)
        if costs:  # measured: the DTensor conversions and collectives around each parallel Linear
            tp += costs["tp_step_s"] + costs["tp_linear_s"] * (profile.tp_linears or 6 * blocks) / lay.pp
        total += tp
        exposed += tp
    if lay.pp > 1:
        micro = local / lay.microbatches
        busy, idle = pipelines.bubble_slots(lay.schedule, lay.pp, lay.microbatches, lay.stages_per_process)
        slots = busy + idle  # each on the critical path hands a micro-batch on (and takes one) beyond its compute
        if costs:  # measured: a slot's sends, receives and schedule work beyond its arithmetic; then the bytes
            p2p = slots * (
                costs["pipeline_slot_s"] + 2 * micro * profile.boundary_bytes_per_sample / p2p_link.bandwidth
            )
        else:
            p2p = 2 * slots * send_s(micro * profile.boundary_bytes_per_sample, p2p_link)
        total += p2p
        exposed += p2p
    if target.intra.hw:  # between GPUs, the collectives hidden behind compute slow it (plan/overlap.py)
        exposed += slowed_s(hidden)
    step = compute + exposed
    return {"compute": compute, "bubble": bubble, "communication": exposed, "communication_total": total, "step": step}


def _sharded(profile: Profile, lay: Layout, stage_bytes: float, units: int) -> tuple[tuple[float, int, int], ...]:
    """(bytes, ranks, units) FSDP2 gathers and scatters: a stage's over the shards, in its `units`; under ep the
    rest over the shards and each rank's experts, a unit a layer, over the dp / ep groups (fsdp+ep), or over
    none (ep)."""
    if lay.ep == 1:
        return ((stage_bytes, lay.shard, units),)
    rest = 4 * (profile.parameters - profile.expert_parameters)
    groups = lay.shard // lay.ep if lay.shard > 1 else 1
    layers = max(1, profile.expert_layers)
    return ((rest, lay.shard, units), (4 * profile.expert_parameters / lay.ep, groups, layers))


def _overheads(target: Target, lay: Layout, calib: Calibration | None) -> dict[str, float]:
    """The strategies' measured per-step overheads (overheads.py) that apply: this machine's at the plan's
    process count; a described CPU cluster's at a process per core (2 here); none on GPUs, whose collectives
    and kernels these CPU figures do not describe."""
    if calib is None or target.rate is not None or lay.processes < 2:
        return {}
    costs = dict(calib.overhead(lay.processes if target.here else 2))
    if not target.here:
        return costs
    # A degree of 2 among 4 processes runs its collectives over pairs: the 2 x 2 mesh's figures, where probed.
    pairs = {k.removeprefix(PAIRS): v for k, v in costs.items() if k.startswith(PAIRS)}
    for degree, names in (
        (lay.shard, ("fsdp_unit_s", "fsdp_step_s")),
        (lay.tp, ("tp_linear_s", "tp_step_s")),
        (lay.replicate, ("ddp_tensor_s", "ddp_step_s")),
        (lay.pp, ("pipeline_slot_s",)),
    ):
        if 1 < degree < lay.processes:
            costs |= {name: pairs[name] for name in names if name in pairs}
    if lay.replicate > 1 and lay.shard > 1 and "hsdp_unit_s" in costs:  # replicated and sharded: hsdp's own
        costs["fsdp_unit_s"], costs["fsdp_step_s"] = costs["hsdp_unit_s"], costs["hsdp_step_s"]
    return costs


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


def predict(
    profile: Profile, lay: Layout, batch: int, target: Target, here_cores: int, calib: Calibration | None
) -> Prediction:
    mem = memory(profile, lay, batch)
    times = step_time(profile, lay, batch, target, here_cores, calib)
    return Prediction(
        lay.strategy,
        lay.processes,
        batch,
        lay.degrees(),
        mem,
        times,
        fits(mem["peak"], lay, target),
        largest_batch(profile, lay, target),
        batch / times["step"] if times["step"] > 0 else 0.0,
    )
