"""`torchfleet verify`'s run: serial and reordered serial here, every other strategy in one launch.

Which strategies apply is read from the model, built on the meta device (shapes only): ddp, fsdp and
pipeline always; tp where the model has a plan (a tp_plan() method, or its config's base_model_tp_plan);
ep where it has experts; on 4 processes or more also fsdp+tp, fsdp+pipeline and hsdp where they apply.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from torchfleet.errors import UsageError
from torchfleet.strategies import registry
from torchfleet.verify import models, train

FLOOR = 1e-5  # a difference below this is rounding, whatever the model (the zoo's bound)
BATCH = 8  # the global batch: 2, 4 or 8 processes each take whole rows


@dataclass
class Row:
    strategy: str
    difference: float | None  # max |w - serial| over every weight; None when refused
    verdict: str  # "equal", "differs", "refused" (one sentence, before training) or "failed" (it crashed)
    seconds: float | None
    reason: str = ""  # the refusal's sentence


@dataclass
class Verdict:
    source: str
    processes: int
    steps: int
    floor: float  # reordered serial's distance from serial
    bound: float  # max(FLOOR, 2 x floor)
    serial_seconds: float
    rows: list[Row] = field(default_factory=list)

    @property
    def differs(self) -> list[str]:
        return [r.strategy for r in self.rows if r.verdict in ("differs", "failed")]


class Batches:
    """The global batches every run of one verify trains on, made once (a user's make_batch may draw from a
    generator of its own, which would give each run other batches): batch(rows, seed) is the seed-th."""

    def __init__(self, batches: list[tuple]):
        self.batches = batches

    def __call__(self, rows: int, seed: int) -> tuple:
        return self.batches[seed]


def parts(source: models.Source, batches: Batches):
    """(build, batch, loss_fn) of `source`: a module-level function, so a launched process can call it."""
    _, _, loss_fn = models.build(source)
    return (lambda: models.build(source)[0]), batches, loss_fn


def applicable(source: models.Source, processes: int) -> list[str]:
    """The strategies that apply to `source`'s model on `processes` processes (see the module doc)."""
    from torchfleet.strategies.expert_parallel import find_experts

    with torch.device("meta"):
        model, _, _ = models.build(source)
    has_plan = callable(getattr(model, "tp_plan", None)) or bool(
        getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    )
    experts = bool(find_experts(model))
    chosen = ["ddp", "fsdp", "pipeline", *(["tp"] if has_plan else []), *(["ep"] if experts else [])]
    if processes >= 4:
        chosen += [*(["fsdp+tp"] if has_plan else []), "fsdp+pipeline", "hsdp"]
    return chosen


def verify(source: models.Source, strategies: list[str] | None, processes: int, steps: int) -> Verdict:
    from torchfleet import launch
    from torchfleet.launcher import LaunchError

    if not 2 <= processes <= 8:
        raise UsageError(f"--nproc-per-node {processes}: verify runs 2 to 8 processes (default 2)")
    chosen = strategies or applicable(source, processes)
    _, make, _ = models.build(source)
    batches = Batches([make(BATCH, seed) for seed in range(steps)])
    build, batch, loss_fn = parts(source, batches)
    serial = train.train_case(registry.REFERENCE, build, batch, loss_fn, steps=steps, batch_size=BATCH)
    assert serial is not None and "weights" in serial, serial  # one process: the main one
    again = train.reordered(build, batch, loss_fn, steps=steps, batch_size=BATCH)
    assert again is not None and "weights" in again, again
    floor = train.max_difference(serial["weights"], again["weights"])
    verdict = Verdict(source.name, processes, steps, floor, max(FLOOR, 2 * floor), serial["seconds"])
    making = functools.partial(parts, source, batches)
    for strategy in chosen:  # a launch each: a strategy that crashes takes only its own row with it
        try:
            got = launch(
                train.matrix, nprocs=processes, args=([(strategy, making, {"steps": steps, "batch_size": BATCH})],)
            )[0][0]
        except LaunchError as error:
            reason = str(error).strip().splitlines()[0][:300]
            verdict.rows.append(Row(strategy, None, "failed", None, reason))
            continue
        if "refused" in got:
            verdict.rows.append(Row(strategy, None, "refused", None, got["refused"]))
            continue
        difference = train.max_difference(serial["weights"], got["weights"])
        equal = difference <= verdict.bound
        verdict.rows.append(Row(strategy, difference, "equal" if equal else "differs", got["seconds"]))
    return verdict
