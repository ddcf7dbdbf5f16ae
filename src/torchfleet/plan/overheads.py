"""What a strategy's own machinery costs per step, beyond the bytes it moves: measured, not assumed.

The ring formulas of comm.py charge each collective its bytes and a per-message
latency from a bare Gloo all-reduce. The strategies pay more than that around
each collective: FSDP2 copies parameters into and out of its flat buffers,
runs pre- and post-hooks and keeps DTensors; tensor parallelism converts
activations to and from DTensors around each parallel Linear; DDP runs its
reducer's hooks and copies gradients into buckets. On a CPU these costs
(a millisecond or more per unit here) dwarf the bare latency, so the plan
measures them with the real wrappers on a tiny model whose parts are known:

    a Sequential of U units, each Linear(W, 2W) -> ReLU -> Linear(2W, W), batch 8, W = 64

timed for a training step (zero_grad, forward, backward, SGD with momentum)
wrapped and not wrapped, in the same processes at the same time (so both see
the same crowding of cores), at two unit counts U1 < U2. Messages are a few
kilobytes, so what is left is overhead, not bandwidth:

    per unit  = ((wrapped(U2) - plain(U2)) - (wrapped(U1) - plain(U1))) / (U2 - U1)
    per step  = (wrapped(U1) - plain(U1)) - U1 x per unit            (never below 0)

For fsdp a unit is one fully_shard (strategies/parallelize.apply_fsdp shards
each block, then the root); for tp a unit holds two parallel Linears (one by
columns, one by rows: gpt.tp_plan's split), so per parallel Linear is half the
unit's; for ddp the per-step figure is the reducer's cost (its gradients fit
one bucket at any U here), and its per-unit figure, over the unit's 4
parameter tensors, the reducer's cost per tensor (a hook and a copy each).

Among 4 processes the strategies that combine two degrees of 2 (hsdp, fsdp+tp,
ddp+pipeline, fsdp+pipeline) run each collective over a pair, two pairs at a
time: the figures are measured once more on a 2 x 2 mesh (fsdp, tp and ddp over
its inner pairs, a 1F1B pipeline of 2 per pair, and hsdp over both dimensions),
which a ring over all 4, waiting on twice as many processes taking turns on the
cores, overstates (about 2x here).
"""

from __future__ import annotations

import time

UNITS = (2, 10)
WIDTH = 64
BATCH = 8
REPEATS = 7
TENSORS_PER_UNIT = 4  # two weights, two biases
PAIRS = "mesh2x2_"  # the figures among 4 processes with each collective over groups of 2


def per_unit(
    wrapped: tuple[float, float], plain: tuple[float, float], units: tuple[int, int] = UNITS
) -> tuple[float, float]:
    """(seconds per unit, seconds per step) of a wrapper's overhead from step times at two unit counts."""
    extra = [w - p for w, p in zip(wrapped, plain, strict=True)]
    unit = max(0.0, (extra[1] - extra[0]) / (units[1] - units[0]))
    return unit, max(0.0, extra[0] - units[0] * unit)


def _model(units: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(units)]
    )


def _training_step(model):
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    data = torch.randn(BATCH, WIDTH)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(data).sum().backward()
        optimizer.step()

    return step


def measure() -> dict[str, float]:
    """In every process of an initialised Gloo group: fsdp's per-unit and per-step overhead, tp's per parallel
    Linear, ddp's per step and per gradient tensor, the pipeline's per slot (the same figures on every rank).

    Among 4 processes the same figures again with each wrapper's collectives over groups of 2 (a 2 x 2 mesh,
    as hsdp, fsdp+tp and the pipelines with ddp or fsdp run on 4), keyed PAIRS + name, and hsdp's own
    (replicated over one dimension, sharded over the other)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    meshes = {"": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes[PAIRS] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    steps = {}
    for units in UNITS:
        steps["plain", units] = _training_step(_model(units))
        for prefix, mesh in meshes.items():
            for name, model in _wrapped(units, mesh, prefix).items():
                steps[name, units] = _training_step(model)
    times = _interleaved(steps)

    def wrapper(name: str) -> tuple[float, float]:
        return per_unit(
            (times[name, UNITS[0]], times[name, UNITS[1]]), (times["plain", UNITS[0]], times["plain", UNITS[1]])
        )

    out = {}
    for prefix in meshes:
        (fsdp_unit, fsdp_step), (tp_unit, tp_step), (ddp_unit, ddp_step) = (
            wrapper(prefix + "sharded"),
            wrapper(prefix + "split"),
            wrapper(prefix + "replicated"),
        )
        out |= {
            prefix + "fsdp_unit_s": fsdp_unit,
            prefix + "fsdp_step_s": fsdp_step,
            prefix + "tp_linear_s": tp_unit / 2,
            prefix + "tp_step_s": tp_step,
            prefix + "ddp_tensor_s": ddp_unit / TENSORS_PER_UNIT,
            prefix + "ddp_step_s": ddp_step,
        }
    if PAIRS in meshes:
        out["hsdp_unit_s"], out["hsdp_step_s"] = wrapper("hybrid")
    out["pipeline_slot_s"] = pipeline_slot()
    if PAIRS in meshes:
        out[PAIRS + "pipeline_slot_s"] = pipeline_slot(mesh=meshes[PAIRS])
    return out


def _wrapped(units: int, mesh, prefix: str) -> dict:
    """The probe model under fsdp, tp and ddp over `mesh`'s innermost dimension (and hsdp over a 2-D mesh), by
    what each does to it: sharded, split, replicated (and hybrid)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    from torchfleet.strategies.parallelize import apply_fsdp

    inner = mesh["inner"] if mesh.ndim == 2 else mesh
    sharded, split = _model(units), _model(units)
    apply_fsdp(sharded, inner)
    parallelize_module(
        split,
        inner,
        {f"{i}.{j}": style for i in range(units) for j, style in ((0, ColwiseParallel()), (2, RowwiseParallel()))},
    )
    models = {
        prefix + "sharded": sharded,
        prefix + "split": split,
        prefix + "replicated": DistributedDataParallel(_model(units), process_group=inner.get_group()),
    }
    if mesh.ndim == 2:
        hybrid = _model(units)
        apply_fsdp(hybrid, mesh)
        models["hybrid"] = hybrid
    return models


def pipeline_slot(microbatches: tuple[int, int] = (4, 12), micro: int = 2, mesh=None) -> float:
    """Seconds a 1F1B pipeline over every process (over `mesh`'s inner dimension: pipelines of 2 side by
    side) adds per micro-batch beyond its stage's arithmetic.

    Each process holds one unit of the probe model as its stage; a micro-batch more adds one slot (a
    forward and a backward of a stage, with their sends and receives and the schedule's own work) to
    the step's critical path, so the step's growth per micro-batch, less one unit's plain forward and
    backward of a micro-batch, is what each slot costs beyond compute.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    group = mesh["inner"].get_group() if mesh is not None else None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    loss_fn = torch.nn.functional.mse_loss
    steps = {}
    for m in microbatches:
        unit = _model(1)[0]  # a stage of its own for each schedule
        optimizer = torch.optim.SGD(unit.parameters(), lr=1e-3, momentum=0.9)
        stage = PipelineStage(unit, rank, world, torch.device("cpu"), group=group)
        schedule = Schedule1F1B(stage, m, loss_fn=loss_fn)
        data, target = torch.randn(m * micro, WIDTH), torch.randn(m * micro, WIDTH)

        def step(schedule=schedule, optimizer=optimizer, data=data, target=target):
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(data)
            elif rank == world - 1:
                schedule.step(target=target)
            else:
                schedule.step()
            optimizer.step()

        steps[m] = step
    unit, plain_data = _model(1)[0], torch.randn(micro, WIDTH)
    steps["plain"] = lambda: unit(plain_data).sum().backward()
    times = _interleaved(steps)
    growth = (times[microbatches[1]] - times[microbatches[0]]) / (microbatches[1] - microbatches[0])
    return max(0.0, growth - times["plain"])


def _interleaved(steps: dict) -> dict:
    """The fastest round's seconds of each step (a round: the slowest rank's, from a barrier), after two
    warm-ups.

    The steps take turns, round after round, so a burst of load from elsewhere on a shared machine
    falls on all of them alike instead of on whichever was being timed when it came; and the fastest
    round, not the median, because such load only ever adds: the fastest is this machine's own cost,
    the one figure that comes out the same from one minute to the next."""
    import torch
    import torch.distributed as dist

    for step in steps.values():
        for _ in range(2):
            step()
    seconds: dict = {key: [] for key in steps}
    for _ in range(REPEATS):
        for key, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            seconds[key].append(time.perf_counter() - start)
    keys = list(steps)
    slowest = torch.tensor([seconds[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {k: min(row) for k, row in zip(keys, slowest.tolist(), strict=True)}
