"""What a traced step holds per rank (Traced), and its figures carried to other depths and worlds.

Tracing costs time per operator, so deep models are traced at a few small
depths (plan/trace.py) and the figures carried to the full depth: every block
is the same, so each kind grows by the same amount per block (`at_depth`) once
the same moment is the peak. The sharded kinds shrink with the number of ranks
and nothing else does (`Traced.at_world`).
"""

from __future__ import annotations

from dataclasses import dataclass

# What FSDP2 divides among the ranks: every other kind is held whole by each rank.
SHARDED_KINDS = ("SHARDED_PARAM", "SHARDED_GRAD", "OPT")


@dataclass(frozen=True)
class Traced:
    """One rank's memory by kind (bytes) at the moments of a step that can be its peak, for `layers` blocks
    sharded over `world` ranks. Which moment is the peak depends on the world: the sharded kinds shrink as
    it grows and the rest does not, so every moment that is highest for some world is kept."""

    layers: int
    world: int  # FSDP's ranks (those of one tensor-parallel rank's shard)
    moments: tuple[dict[str, float], ...]
    flops: float = 0.0  # one rank's step, by torch's FLOP formulas (recomputation included)
    # One rank's tensor-parallel collectives in a step, as DTensor issued them: (kind, bytes, calls), the
    # bytes summed over the calls, each call's the whole tensor it moves, as plan/comm.py's formulas take it.
    collectives: tuple[tuple[str, float, float], ...] = ()
    # What one micro-batch's forward leaves for its backward (its saved activations and its input): what each
    # further micro-batch a pipeline stage holds in flight adds.
    held: float = 0.0
    # One rank's step by what bounds its kernels (plan/kernels.py): ("matmul", FLOPs), ("attention", FLOPs),
    # ("memory", bytes the other operators read and write).
    work: tuple[tuple[str, float], ...] = ()

    @property
    def kinds(self) -> dict[str, float]:
        """The peak moment's figures."""
        return max(self.moments, key=lambda kinds: sum(kinds.values()))

    @property
    def peak(self) -> float:
        return sum(self.kinds.values())

    def at_world(self, world: int) -> Traced:
        scale = self.world / world
        return Traced(
            self.layers,
            world,
            tuple({k: v * scale if k in SHARDED_KINDS else v for k, v in m.items()} for m in self.moments),
            self.flops,
            self.collectives,
            self.held,
            self.work,
        )


def candidate_moments(moments: list[dict[str, float]]) -> tuple[dict[str, float], ...]:
    """The moments that are the peak for some number of ranks: those no other moment exceeds in both the
    sharded and the whole-held kinds."""

    def split(kinds):
        sharded = sum(v for k, v in kinds.items() if k in SHARDED_KINDS)
        return sum(kinds.values()) - sharded, sharded

    kept, best_sharded = [], -1.0
    for kinds in sorted(moments, key=lambda m: (-split(m)[0], -split(m)[1])):
        if split(kinds)[1] > best_sharded:
            kept.append(kinds)
            best_sharded = split(kinds)[1]
    return tuple(kept)


def at_depth(low: Traced, high: Traced, layers: int) -> Traced:
    """The figures for `layers` blocks, carried linearly from traces at two depths (same world)."""
    low_kinds, high_kinds = low.kinds, high.kinds
    per_block = {
        k: (high_kinds.get(k, 0.0) - low_kinds.get(k, 0.0)) / (high.layers - low.layers)
        for k in set(low_kinds) | set(high_kinds)
    }
    kinds = {k: low_kinds.get(k, 0.0) + per_block[k] * (layers - low.layers) for k in per_block}

    def carried(a: float, b: float) -> float:
        return a + (b - a) / (high.layers - low.layers) * (layers - low.layers)

    low_comm = {kind: (nbytes, calls) for kind, nbytes, calls in low.collectives}
    collectives = tuple(
        (kind, carried(low_comm.get(kind, (0.0, 0.0))[0], nbytes), carried(low_comm.get(kind, (0.0, 0.0))[1], calls))
        for kind, nbytes, calls in high.collectives
    )
    return Traced(
        layers,
        low.world,
        ({k: v for k, v in sorted(kinds.items()) if v > 0},),
        carried(low.flops, high.flops),
        collectives,
        carried(low.held, high.held),
        tuple((kind, carried(dict(low.work).get(kind, 0.0), amount)) for kind, amount in high.work),
    )
