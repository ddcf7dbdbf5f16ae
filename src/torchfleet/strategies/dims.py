"""Parallel dimensions: the degree of each parallelism, checked once, and the one mesh.

Every multi-process strategy is a preset of four degrees (torchtitan's
names): ``dp_replicate`` (whole replicas, gradients averaged by DDP, or by
FSDP2 inside a pipeline or beside tp),
``dp_shard`` (FSDP2 shards parameters, gradients and optimizer state),
``pp`` (pipeline stages) and ``tp`` (tensor parallelism: each layer of the
model's plan split across processes). Their product is the number of processes:

    ddp            dp_replicate = N
    fsdp           dp_shard = N
    hsdp           dp_replicate = R, dp_shard = N / R   (FSDP2's 2-D mesh)
    pipeline       pp = N
    ddp+pipeline   dp_replicate = N / pp, pp
    fsdp+pipeline  dp_shard = N / pp, pp
    tp             tp = N
    fsdp+tp        dp_shard = N / tp, tp (default 2)
    ep             dp_replicate = N, ep = N
    fsdp+ep        dp_shard = N, ep (default 2)
    ep --tp T      dp_replicate = N / T, ep = N / T, tp = T   ("ep+tp")
    fsdp+ep --tp T dp_shard = N / T, ep (default 2), tp = T   ("fsdp+ep+tp")

`--dp-replicate`, `--dp-shard`, `--pp` and `--tp` set a degree directly; the
preset fills the rest. The mesh is ("dp_replicate", "dp_shard", "pp", "tp"),
row-major, so the ranks of a tensor-parallel group are neighbours (on one
machine, where the all-reduce each of their layers needs travels fastest, as
torchtitan places them), then a pipeline's stages (the activations they pass
each micro-batch), and replicas are farthest apart (across machines, where
only one gradient all-reduce per step crosses). With tp = 1 the layout is the
one ddp+pipeline had before the dimensions existed, so its ranks and
checkpoints are unchanged.

``ep`` (expert parallelism) does not multiply: like torchtitan's, it borrows
data-parallel processes. Each group of ``ep`` neighbouring data-parallel ranks
splits every mixture-of-experts layer's experts among itself and sends each
token to its experts' rank (strategies/expert_parallel.py); the experts are
then replicated, or sharded by FSDP2, over the ``dp / ep`` groups, on a mesh
of their own, ("dp_mod_ep", "ep") (torchtitan's name for the first). Beside
tp that mesh is ("dp_mod_ep", "ep", "tp"): each expert a rank of an ep group
keeps is split over its tp group as the model's plan splits it (or kept whole
where the plan leaves the experts whole), and each tp column of ranks routes
its tokens among itself, as the ranks of one column hold the same slices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchfleet.errors import UsageError
from torchfleet.strategies.registry import BORROWED_DIMS, DIM, DIM_NAMES, DIMS, EP, PP, TP, find, name_of_degrees

# --dp-replicate, --dp-shard, --pp, --tp, --ep. Each preset's degrees are declared with the preset, in
# strategies/registry.py.
DEGREE_FLAGS = {name: "--" + name.replace("_", "-") for name in (*DIM_NAMES, *BORROWED_DIMS)}


def _no_tp_in_pipelines(what: str) -> UsageError:
    return UsageError(
        f"{what}: tensor parallelism inside pipeline stages is not supported yet;"
        " drop --tp, or drop --pp and use tp or fsdp+tp"
    )


class ParallelDims:
    """The degree of every dimension the mesh declares (strategies/preset.py's DIMS), 1 where not given, read as
    attributes (``dims.tp``), and the number of processes; checked once, when made. Positional degrees are
    dp_replicate, dp_shard, pp and tp, in the mesh's order."""

    world_size: int
    degrees: Mapping[str, int]

    def __init__(self, *degrees: int, world_size: int, **named: int) -> None:
        given = dict(zip(DIM_NAMES, degrees, strict=False))
        unknown = sorted(set(named) - set(DIM)) or (
            ["a fifth positional degree"] if len(degrees) > len(DIM_NAMES) else []
        )
        if unknown or set(given) & set(named):
            raise TypeError(f"ParallelDims: {unknown[0] if unknown else 'a degree given twice'}")
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "degrees", MappingProxyType({d.name: 1 for d in DIMS} | given | named))
        self._check()

    def __getattr__(self, name: str) -> int:
        if name.startswith("__") or name == "degrees":  # asked before `degrees` exists (unpickling)
            raise AttributeError(name)
        try:
            return self.degrees[name]
        except KeyError:
            raise AttributeError(f"ParallelDims has no dimension {name!r}") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ParallelDims is frozen: make another")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParallelDims) and (self.world_size, dict(self.degrees)) == (
            other.world_size,
            dict(other.degrees),
        )

    def __hash__(self) -> int:
        return hash((self.world_size, tuple(self.degrees.values())))

    def __repr__(self) -> str:
        return f"ParallelDims({', '.join(f'{n}={v}' for n, v in self.degrees.items())}, world_size={self.world_size})"

    def __reduce__(self):  # the degrees' mapping is a read-only view, which pickle cannot copy
        return (_made, (self.world_size, dict(self.degrees)))

    def _check(self) -> None:
        for name, degree in self.degrees.items():
            if degree < 1:
                raise UsageError(f"{DEGREE_FLAGS[name]} {degree} must be at least 1")
        if math.prod(self.degrees[n] for n in DIM_NAMES) != self.world_size:
            raise UsageError(
                f"{self.arithmetic()} != {self.world_size} processes; choose degrees whose"
                f" product is the number of processes"
            )
        if self.tp > 1 and self.pp > 1:
            raise _no_tp_in_pipelines(self.arithmetic())
        if self.ep > 1:
            self._check_ep()

    def _check_ep(self) -> None:
        """ep borrows data-parallel ranks of one kind: every replica (ep), or shards (fsdp+ep); tp may split
        what each rank keeps."""
        if self.pp > 1:
            raise UsageError(
                f"--ep {self.ep} with {self.arithmetic()}: expert parallelism beside pipeline stages is"
                " not supported yet; drop --pp, or choose a strategy without ep"
            )
        if self.dp_shard > 1 and self.dp_replicate > 1:
            raise UsageError(
                f"--ep {self.ep} with {self.arithmetic()}: expert parallelism beside both replicas and shards"
                " is not supported yet; use fsdp+ep, or ep"
            )
        if self.dp_shard == 1 and self.ep != self.dp_replicate:
            raise UsageError(
                f"--ep {self.ep} with {self.dp_replicate} replicas: ep splits the experts over every process"
                f" (--ep {self.dp_replicate}); to split them over fewer, use fsdp+ep"
            )
        if self.dp % self.ep:
            raise UsageError(
                f"--ep {self.ep} does not divide the {self.dp} data-parallel processes; choose a divisor of {self.dp}"
            )

    def arithmetic(self) -> str:
        """ "dp_replicate(2) * dp_shard(1) * pp(2)", with tp(N) when there is tensor parallelism."""
        product = " * ".join(f"{n}({self.degrees[n]})" for n in DIM_NAMES if DIM[n].shown or self.degrees[n] > 1)
        borrowed = "".join(f", {n}({self.degrees[n]})" for n in BORROWED_DIMS if self.degrees[n] > 1)
        return product + borrowed

    @classmethod
    def from_preset(cls, preset: str, world_size: int, nodes: int = 1, **given: int | None) -> ParallelDims:
        """The degrees of `preset` on `world_size` processes, with the flags in `given` applied.

        hsdp replicates across machines when there are several (`nodes`), shards within each.
        """
        fixed = {n: v for n, v in given.items() if v is not None}
        ep = fixed.pop(EP, None)
        degrees = {n: 1 for n in DIM_NAMES}
        free = []
        declared = find(preset)
        if declared is None or declared.degrees is None:
            raise UsageError(f"strategy {preset!r} is not a preset of the mesh's degrees")
        defaults = dict(declared.degrees)
        ep_default = defaults.pop(EP, 1)
        # Asked for together, even where the processes would leave one of them at 1
        # (tp with --pp 2 on 2 processes would otherwise quietly run a pipeline alone).
        for asked, flag in ((TP, PP), (PP, TP)):
            if asked in defaults and fixed.get(flag, 1) > 1:
                raise _no_tp_in_pipelines(f"{preset} with {DEGREE_FLAGS[flag]} {fixed[flag]}")
        if declared.across_nodes and nodes > 1:  # hsdp: a replica per machine
            defaults[declared.across_nodes] = nodes
        for name, default in defaults.items():
            if name in fixed:
                continue
            if default is None:
                free.append(name)
            else:
                degrees[name] = default
        degrees.update(fixed)
        if free:  # the one degree the preset leaves open takes the processes left over
            (name,) = free
            others = math.prod(v for n, v in degrees.items() if n != name)
            degrees[name] = max(1, world_size // max(1, others))
        if ep is None:  # the preset's, None meaning every data-parallel rank (never more than there are)
            dp = math.prod(degree for name, degree in degrees.items() if DIM[name].reads_data)
            ep = dp if ep_default is None else min(ep_default, dp)
        return cls(world_size=world_size, ep=ep, **degrees)  # checks every degree and the product

    # -- what follows from the degrees -------------------------------------
    @property
    def dp(self) -> int:
        """Processes that read different data: one per data-parallel rank (a pipeline's stages
        and a tensor-parallel group's ranks share one)."""
        return math.prod(self.degrees[n] for n in DIM_NAMES if DIM[n].reads_data)

    @property
    def name(self) -> str:
        """The preset these degrees are ("ddp", "hsdp+pipeline", "fsdp+tp", ...), as the registry names them."""
        return name_of_degrees([n for n, degree in self.degrees.items() if degree > 1])

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (the mesh is row-major)."""
        place = {}
        for name in reversed(DIM_NAMES):
            rank, place[name] = divmod(rank, self.degrees[name])
        # ep groups are neighbouring data-parallel ranks (pp is 1 beside ep), one group per tp column
        return {name: place[name] for name in DIM_NAMES} | {EP: self._data_rank(place) % self.ep}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel share `rank` reads, 0 .. dp-1."""
        return self._data_rank(self.coords(rank))

    def _data_rank(self, place: Mapping[str, int]) -> int:
        """The row-major index of `place` over the dimensions whose ranks read different data."""
        index = 0
        for name in DIM_NAMES:
            if DIM[name].reads_data:
                index = index * self.degrees[name] + place[name]
        return index

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The one DeviceMesh every parallelism of this run is applied over."""
        return init_device_mesh(device_type, tuple(self.degrees[n] for n in DIM_NAMES), mesh_dim_names=DIM_NAMES)

    def build_expert_mesh(self, device_type: str) -> DeviceMesh:
        """The experts' own 2-D mesh ("dp_mod_ep", "ep"): split over "ep", neighbours, as the all-to-all
        between them is the heaviest traffic of the step; replicated or sharded over "dp_mod_ep".
        One mesh holding both, as FSDP2 needs for parameters already split over another dimension. Beside tp,
        a third dimension, "tp", last as in the main mesh, so each rank keeps its place."""
        shape, names = (self.dp // self.ep, self.ep), ("dp_mod_ep", EP)
        if self.tp > 1:
            shape, names = (*shape, self.tp), (*names, TP)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def _made(world_size: int, degrees: dict[str, int]) -> ParallelDims:
    """ParallelDims unpickled (`ParallelDims.__reduce__`)."""
    return ParallelDims(world_size=world_size, **degrees)
