"""The degrees one strategy runs with on a number of processes (Layout), by the strategy's own rules.

Every multi-process strategy is a preset of four degrees (strategies/dims.py):
replicas r (dp_replicate), shards s (dp_shard), pipeline stages p and
tensor-parallel ranks t, and expert parallelism e borrows data-parallel ranks
(ep, fsdp+ep); a pipeline adds its micro-batches and schedule, diloco
and localsgd their steps between meetings. plan/predict.py's formulas take a
strategy's memory and time from these alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torchfleet.errors import UsageError
from torchfleet.plan import pipelines
from torchfleet.plan.profile import Profile
from torchfleet.strategies import registry

MP_MICROBATCHES = 4  # strategies/mp.py's default
# The dimensions these formulas price (strategies/preset.py declares them all): Layout's degrees.
PRICED = (registry.DP_REPLICATE, registry.DP_SHARD, registry.PP, registry.TP, registry.EP)


@dataclass(frozen=True)
class Layout:
    strategy: str
    processes: int
    replicate: int = 1
    shard: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1  # expert-parallel ranks, borrowed from the replicas (ep) or the shards (fsdp+ep)
    microbatches: int = 1
    schedule: str = "1f1b"
    stages_per_process: int = 1  # v: the model cut into pp x v stages (the looped and V schedules)
    sync_every: int = 1  # diloco and localsgd: steps between meetings

    @property
    def readers(self) -> int:
        return self.replicate * self.shard

    @property
    def cost(self) -> str | None:
        """How the strategy is costed (registry.Preset.cost): "mesh", "meetings", "stages here", "one", "here"."""
        return registry.presets()[self.strategy].cost

    @property
    def hybrid(self) -> bool:
        """Its preset replicates and shards (hsdp): FSDP2's collectives even where the shards come to 1."""
        return {registry.DP_REPLICATE, registry.DP_SHARD} <= set(registry.presets()[self.strategy].degrees or ())

    def degrees(self) -> str:
        """Short: "rep2 x shard2", "pp2 m4" (m: micro-batches), "shard4, ep2", "-" for one process."""
        parts = [
            f"{k}{v}"
            for k, v in (("rep", self.replicate), ("shard", self.shard), (registry.PP, self.pp), (registry.TP, self.tp))
            if v > 1
        ]
        text = " x ".join(parts) + (f", ep{self.ep}" if self.ep > 1 else "")  # borrowed, not multiplied
        if self.pp > 1 or self.cost == "stages here":
            text += f" m{self.microbatches}"
        if self.pp > 1 and self.schedule != "1f1b":
            text += f" {self.schedule}" + (f" v{self.stages_per_process}" if self.stages_per_process > 1 else "")
        return text.strip() or "-"


def layout(
    strategy: str, processes: int, batch: int, profile: Profile, options: dict | None = None, cpu_threads: int = 0
) -> Layout:
    """The degrees `strategy` runs with; UsageError (from the strategy's own rules) where it cannot."""
    from torchfleet.replica_groups.sync_methods import DEFAULT_SYNC_EVERY
    from torchfleet.strategies import resolve_dims
    from torchfleet.strategies.options import StrategyOptions

    given = registry.options_for(strategy, options)
    typed = StrategyOptions.of(given)
    pipeline = typed.pipeline
    cost = registry.presets()[strategy].cost
    if cost == "stages here":
        return Layout(strategy, 1, microbatches=pipeline.microbatches or MP_MICROBATCHES)
    if cost == "meetings":
        every = typed.replica_groups.sync_every or DEFAULT_SYNC_EVERY
        return Layout(strategy, processes, replicate=processes, sync_every=every)
    dims = resolve_dims(strategy, processes, options=given)
    if dims is None:
        return Layout(strategy, 1)
    unpriced = [f"{n}({v})" for n, v in dims.degrees.items() if v > 1 and n not in PRICED]
    if unpriced:  # a dimension declared since these formulas were written: left out, not priced as another
        raise UsageError(f"plan does not cost {', '.join(unpriced)} yet; bench measures {strategy} instead")
    lay = Layout(strategy, processes, dims.dp_replicate, dims.dp_shard, dims.pp, dims.tp, dims.ep)
    if dims.pp > 1:
        from torchfleet.strategies.pipeline.schedules import default_schedule, microbatch_problem
        from torchfleet.strategies.pipeline.stages import default_microbatches

        schedule = pipeline.schedule or default_schedule(pipeline.stages_per_process)
        per = pipelines.stages_per_process(schedule, pipeline.stages_per_process)
        local = max(1, batch // lay.readers)
        # The pipelines' own rule (strategies/pipeline/stages.py); --check re-predicts with the count a cell really used.
        m = (
            pipeline.microbatches
            or default_microbatches(
                local,
                dims.pp,
                lambda m: microbatch_problem(schedule, dims.pp, m) is None,
                profile.pointwise_convs and cpu_threads == 1,
            )
            or 2 * dims.pp
        )
        lay = Layout(**{**asdict(lay), "microbatches": m, "schedule": schedule, "stages_per_process": per})
    return lay
