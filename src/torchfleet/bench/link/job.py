"""bench's link mode: the machines, and the job each runs (the cells, in order, one workload), from the flags,
validated once.

Node 0's job is the one run: it is sent to the other machines, which say where their own flags differ
and run it anyway, so a flag typed differently on one machine cannot make the cells measure different
things. Bad input is one sentence (UsageError), before anything starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchfleet.errors import UsageError, choice_error

# Every cell is one process per machine with the same model, global batch and timed steps. The baseline, whose
# every step all-reduces the gradients, is the cell every speed-up is measured against (and PowerSGD's wrapper).
BASELINE = "ddp"
CELLS = (BASELINE, "powersgd", "diloco", "localsgd")
DEFAULT_CELLS = (BASELINE, "powersgd", "diloco")
MEETING_CELLS = ("diloco", "localsgd")  # replica groups, one per machine, under --fault-tolerance step
# A bench run is a few tens of steps, where the strategies' default of 100 would never meet: 10 meets
# five times in the default run and still exchanges a tenth of what ddp does.
DEFAULT_SYNC_EVERY = 10
DEFAULT_POWERSGD_RANK = 2  # ddp's own default (strategies/ddp.py)
# gpt tiny, 16 sequences of 64 tokens per machine (benchmarks/slow_text.py's job): small enough that its
# all-reduce on a slow link outlasts its compute, so the link decides what the cells show.
DEFAULT_MODEL, DEFAULT_PRESET, DEFAULT_GLOBAL_BATCH = "gpt", "tiny", 32
DEFAULT_WARMUP, DEFAULT_STEPS = 10, 50
QUICK_STEPS = 20
# Strategy flags the cells take; any other is refused rather than silently dropped.
LINK_OPTIONS = ("sync_every", "outer_lr", "outer_momentum", "powersgd_rank")
DEFAULT_MASTER_PORT = 29500  # torchrun's
SEE = "run the same command on every machine, e.g. torchfleet bench --nnodes 2 --node-rank 0 --master-addr 10.0.0.1"


@dataclass(frozen=True)
class Machines:
    """Where this machine stands. Ports: the preflight and the bench's store on master_port, cell i's
    rendezvous (or diloco's lighthouse) on master_port + 1 + i, so no cell waits for another's to close."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int = DEFAULT_MASTER_PORT

    def cell_port(self, index: int) -> int:
        return self.master_port + 1 + index


@dataclass(frozen=True)
class LinkJob:
    """What every machine runs: the cells, in order, on the same workload."""

    cells: tuple[str, ...] = DEFAULT_CELLS
    model: str = DEFAULT_MODEL
    gpt_preset: str = DEFAULT_PRESET
    image_size: int = 224
    global_batch: int = DEFAULT_GLOBAL_BATCH
    precision: str = "fp32"
    warmup: int = DEFAULT_WARMUP
    steps: int = DEFAULT_STEPS  # timed, a whole number of blocks of sync_every steps
    sync_every: int = DEFAULT_SYNC_EVERY
    powersgd_rank: int = DEFAULT_POWERSGD_RANK
    outer_lr: float | None = None  # None: diloco's own default
    outer_momentum: float | None = None
    seed: int = 0
    cell_timeout_s: float = 600.0  # a cell still running then is stopped and reported

    def fleet_options(self, cell: str) -> dict:
        """The `Fleet(...)` arguments of `cell`."""
        if cell == BASELINE:
            return {"strategy": BASELINE}
        if cell == "powersgd":
            return {"strategy": BASELINE, "grad_compression": "powersgd", "powersgd_rank": self.powersgd_rank}
        outer = {
            k: v
            for k, v in (("outer_lr", self.outer_lr), ("outer_momentum", self.outer_momentum))
            if v is not None and cell == "diloco"
        }
        return {"strategy": cell, "sync_every": self.sync_every, **outer}

    def label(self, cell: str) -> str:
        if cell == "powersgd":
            return f"ddp + PowerSGD (rank {self.powersgd_rank})"
        if cell in MEETING_CELLS:
            return f"{cell} (meeting every {self.sync_every} steps)"
        return cell


def machines_from_flags(
    nnodes: str | None, node_rank: int | None, master_addr: str | None, master_port: int | None
) -> Machines | None:
    """The machines of a link-mode run, or None when no node flag is given (bench this machine)."""
    if nnodes is None and node_rank is None and master_addr is None and master_port is None:
        return None
    if nnodes is None:
        raise UsageError(
            "--node-rank, --master-addr and --master-port are for bench's link mode, which also needs"
            f" --nnodes N (2 or more): {SEE}"
        )
    text = nnodes.strip()
    if not text.isdigit():
        raise UsageError(
            f"--nnodes {nnodes!r} is not a number of machines: bench's link mode needs a fixed N,"
            " 2 or more, the same on every machine"
        )
    count = int(text)
    if count < 2:
        raise UsageError(
            f"--nnodes {count} has no link to measure: bench's link mode runs on 2 or more machines;"
            " leave the node flags out to bench the strategies of this one machine"
        )
    rank = 0 if node_rank is None else node_rank
    if not 0 <= rank < count:
        raise UsageError(
            f"--node-rank {rank} is out of range for --nnodes {count}: give each machine its own"
            f" index, 0 to {count - 1}"
        )
    if not master_addr:
        raise UsageError(
            "bench's link mode needs --master-addr: node 0's address, which every machine reaches"
            " (the same on every machine)"
        )
    port = DEFAULT_MASTER_PORT if master_port is None else master_port
    cells = len(CELLS)  # at most: a port for each
    if not 1 <= port <= 65535 - cells:
        raise UsageError(
            f"--master-port {port} is not a TCP port with {cells} free after it: bench's link mode"
            f" uses it and the next {cells}, one per cell; give 1 to {65535 - cells}"
        )
    return Machines(count, rank, master_addr, port)


def _one(values: tuple | None, flag: str, default):
    if values is None or len(values) == 0:
        return default
    if len(values) > 1:
        raise UsageError(
            f"{flag} {','.join(map(str, values))}: bench's link mode measures one value, the same in"
            f" every cell; give one"
        )
    return values[0]


def _blocks(value: int, sync_every: int, least: int) -> int:
    """`value` steps rounded up to whole blocks of `sync_every` steps, at least `least` blocks."""
    return max(least, math.ceil(value / sync_every)) * sync_every


def job_from_flags(flags: dict, options: dict, nnodes: int, quick: bool = False) -> tuple[LinkJob, list[str]]:
    """The plan and notes about what was chosen, from bench's flags (`flags`: model, gpt_preset,
    image_size, strategies, nproc, batch_sizes, precisions, warmup, steps; None where not given) and
    the strategy flags given (`options`). UsageError for what link mode cannot measure."""
    from torchfleet.bench.config import BenchConfig
    from torchfleet.replica_groups.sync_methods import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, SyncOptions

    notes: list[str] = []
    if flags.get("nproc"):
        raise UsageError(
            "--nproc does not apply to bench's link mode: it runs one process per machine, so that"
            " every exchange crosses the link"
        )
    for name in options:
        if name not in LINK_OPTIONS:
            flag = "--" + name.replace("_", "-")
            raise UsageError(
                f"{flag} does not apply to bench's link mode, whose cells are ddp, ddp with PowerSGD"
                f" and diloco (it takes {', '.join('--' + o.replace('_', '-') for o in LINK_OPTIONS)})"
            )
    cells = tuple(dict.fromkeys(flags.get("strategies") or DEFAULT_CELLS))
    for cell in cells:
        if cell not in CELLS:
            raise choice_error("link-mode cell", cell, CELLS)
    if BASELINE not in cells:
        cells = (BASELINE, *cells)
        notes.append(f"{BASELINE} added: it is the baseline every speed-up is measured against")
    sync_every = options.get("sync_every", DEFAULT_SYNC_EVERY)
    if sync_every < 1:  # said here: diloco's own sentence gives train's default
        raise UsageError(
            f"--sync-every {sync_every} must be a whole number of steps, at least 1 (link mode's"
            f" default is {DEFAULT_SYNC_EVERY})"
        )
    # diloco's own checks, so a bad --sync-every or --outer-lr reads as it does for train.
    SyncOptions(
        "diloco",
        sync_every,
        options.get("outer_lr", DEFAULT_OUTER_LR),
        options.get("outer_momentum", DEFAULT_OUTER_MOMENTUM),
    )
    rank = options.get("powersgd_rank", DEFAULT_POWERSGD_RANK)
    if rank < 1:
        raise UsageError(f"--powersgd-rank {rank} must be at least 1")
    batch = _one(flags.get("batch_sizes"), "--batch-sizes", DEFAULT_GLOBAL_BATCH)
    if batch % nnodes:
        raise UsageError(
            f"--batch-sizes {batch} does not split evenly among the {nnodes} machines; give a"
            f" multiple of {nnodes} (the global batch, one process per machine)"
        )
    precision = _one(flags.get("precisions"), "--precisions", "fp32")
    given_warmup, given_steps = flags.get("warmup"), flags.get("steps")
    warmup: int = DEFAULT_WARMUP if given_warmup is None else given_warmup
    steps: int = (QUICK_STEPS if quick else DEFAULT_STEPS) if given_steps is None else given_steps
    model = flags.get("model") or DEFAULT_MODEL
    # BenchConfig's own checks: a model, preset, precision or step count it refuses, link mode refuses alike.
    checked = BenchConfig(
        model=model,
        gpt_preset=flags.get("gpt_preset") or DEFAULT_PRESET,
        image_size=flags.get("image_size") or 224,
        precisions=(precision,),
        warmup=warmup,
        steps=steps,
    )
    # Timed steps come in blocks of sync_every, each ending with one diloco meeting, so every cell's step
    # time carries its share of the meetings; the warm-up is whole blocks too (the first holds the groups'
    # first meeting), so the timed blocks start just after a meeting.
    timed, warm = _blocks(steps, sync_every, 2), _blocks(warmup, sync_every, 1)
    if timed != steps:
        notes.append(
            f"--steps {steps} rounded up to {timed}: whole blocks of --sync-every {sync_every} steps, at"
            " least two, each ending with one diloco meeting"
        )
    if warm != warmup:
        notes.append(
            f"--warmup {warmup} rounded up to {warm}: whole blocks of --sync-every {sync_every} steps, so"
            " timing starts just after a meeting"
        )
    plan = LinkJob(
        cells=cells,
        model=checked.model,
        gpt_preset=checked.gpt_preset or DEFAULT_PRESET,
        image_size=checked.image_size,
        global_batch=batch,
        precision=precision,
        warmup=warm,
        steps=timed,
        sync_every=sync_every,
        powersgd_rank=rank,
        outer_lr=options.get("outer_lr"),
        outer_momentum=options.get("outer_momentum"),
    )
    return plan, notes
