"""The mesh's dimensions are declared once (strategies/preset.py's DIMS); the degrees, their flags, each rank's
place, the mesh, what FSDP2 shards over and what a step enters all follow from the declarations.

The last test declares a dimension of its own, as a newcomer adding one would: its ranks read the same batch,
FSDP2 shards over it beside dp_shard, and its declared function cuts each step's batch among its ranks. Run on 4
real Gloo processes, it must end with serial's weights.
"""

import math
import os
import pickle
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from helpers import ROOT, clean_env, read_outputs, said
from torchfleet.env import DistEnv
from torchfleet.precision import Precision
from torchfleet.strategies import registry, resolve_dims
from torchfleet.strategies.base import Runtime
from torchfleet.strategies.dims import ParallelDims
from torchfleet.strategies.options import Degrees, StrategyOptions, flags
from torchfleet.strategies.serial import Serial


def test_every_declared_dimension_is_a_degree_and_a_flag():
    names = [d.name for d in registry.DIMS]
    assert names == ["dp_replicate", "dp_shard", "pp", "tp", "ep"]
    assert [f for f in Degrees.__dataclass_fields__] == names
    assert {"--" + n.replace("_", "-") for n in names} <= {flag for flag, _, _ in flags()}
    assert StrategyOptions.of({"tp": 2}).degrees.tp == 2


def _old_coords(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Each rank's place as the hand-written dataclass gave it, before the dimensions were declared."""
    rank, column = divmod(rank, dims.tp)
    rank, stage = divmod(rank, dims.pp)
    replica, shard = divmod(rank, dims.dp_shard)
    return {"dp_replicate": replica, "dp_shard": shard, "pp": stage, "tp": column, "ep": rank % dims.ep}


# Degree flags beside the presets: the borrowed ep beside tp, a pipeline asked of ddp, hsdp's replicas.
FLAGGED = [("ep", {"tp": 2}), ("fsdp+ep", {"tp": 2}), ("ddp", {"pp": 2}), ("hsdp", {"dp_replicate": 4})]


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_each_rank_has_the_place_the_hand_written_degrees_gave(processes):
    cases = [(n, {}) for n, p in registry.presets().items() if p.mesh and p.min_processes <= processes]
    cases += [(n, o) for n, o in FLAGGED if processes >= 4 * (2 if n == "fsdp+ep" or "dp_replicate" in o else 1)]
    for name, options in cases:
        dims = resolve_dims(name, processes, options=options)
        assert dims is not None
        assert dims.dp == dims.dp_replicate * dims.dp_shard, name
        for rank in range(processes):
            old = _old_coords(dims, rank)
            assert dims.coords(rank) == old, (name, options, rank)
            assert dims.dp_rank(rank) == old["dp_replicate"] * dims.dp_shard + old["dp_shard"], (name, rank)
        assert math.prod(dims.degrees[n] for n in registry.DIM_NAMES) == processes
        assert pickle.loads(pickle.dumps(dims)) == dims and hash(pickle.loads(pickle.dumps(dims))) == hash(dims)
    assert len(cases) >= 7  # every preset that fits, not a loop over nothing


def test_degrees_are_frozen_and_an_unknown_dimension_is_refused():
    dims = ParallelDims(2, 1, 2, world_size=4)
    assert (dims.dp_replicate, dims.pp, dims.tp, dims.name) == (2, 2, 1, "ddp+pipeline")
    with pytest.raises(AttributeError, match="frozen"):
        dims.tp = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="cp"):
        ParallelDims(world_size=2, cp=2)
    with pytest.raises(AttributeError, match="no dimension 'cp'"):
        _ = dims.cp


def test_a_step_enters_what_the_dimensions_asked_for_around_forward_and_backward():
    seen = []

    def context(label):
        import contextlib

        @contextlib.contextmanager
        def enter(inputs, targets):
            seen.append((label, "in", tuple(inputs.shape), model.weight.grad is None))
            yield
            seen.append((label, "out", model.weight.grad is None))

        return enter

    model = nn.Linear(3, 1)
    cpu = torch.device("cpu")
    strategy = Serial(Runtime(DistEnv(), cpu, Precision("fp32", cpu), None))
    strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), None)  # type: ignore[arg-type]
    strategy.step_contexts = (context("a"), context("b"))
    strategy.train_step(torch.ones(4, 3), torch.zeros(4, 1), nn.MSELoss())
    # entered in order before the forward (no gradient yet), left in reverse after the backward (one there)
    assert seen == [("a", "in", (4, 3), True), ("b", "in", (4, 3), True), ("b", "out", False), ("a", "out", False)]


# A newcomer's dimension: "halves" sits before tp in the mesh; its ranks read the same batch (reads_data False),
# FSDP2 shards over it with dp_shard, and its function cuts each step's batch among its ranks, as context
# parallelism cuts the sequence.
EXTENSION = """
import contextlib


def apply_halves(model, mesh, dims):
    index, size = mesh.get_local_rank(), mesh.size()

    @contextlib.contextmanager
    def enter(inputs, targets):
        wholes = [(t, t.clone()) for t in (inputs, targets)]
        for t, whole in wholes:
            part = whole.tensor_split(size)[index].clone()
            t.resize_(part.shape)
            t.copy_(part)
        try:
            yield
        finally:
            for t, whole in wholes:
                t.resize_(whole.shape)
                t.copy_(whole)

    return enter
"""

JOB = """
import importlib.util, pathlib, sys

import torchfleet.errors  # the package's root imports nothing else
# The declaration module loaded first and given the new dimension, as an edit of strategies/preset.py would.
path = pathlib.Path(torchfleet.errors.__file__).parent / "strategies" / "preset.py"
spec = importlib.util.spec_from_file_location("torchfleet.strategies.preset", path)
preset = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = preset
spec.loader.exec_module(preset)
preset.DIMS = (*preset.DIMS[:3], preset.Dim("halves", "halves of each batch", sharded_over=True,
               applies="declared_ext.halves:apply_halves"), *preset.DIMS[3:])
preset.DIM.clear()
preset.DIM.update({d.name: d for d in preset.DIMS})
preset.DIM_NAMES = tuple(d.name for d in preset.DIMS if not d.borrowed)

import torch
from torch import nn

import torchfleet
from torchfleet.strategies import registry

registry.register(registry.Preset("fsdp+halves", "test", "test", {"dp_shard": None, "halves": 2}))
out, *degrees = sys.argv[1:]
given = {k: int(v) for k, v in (d.split("=") for d in degrees)}
fleet = torchfleet.Fleet(strategy="fsdp+halves" if given else "serial", **given)
torch.manual_seed(0)
net = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)), nn.Linear(6, 1))
seen = []  # the samples each forward took: the batch's share, cut once more by halves' step context
net[0].register_forward_pre_hook(lambda _module, args: seen.append(args[0].shape[0]))
model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g))
for inputs, targets in fleet.dataloader(data, batch_size=16, seed=0):
    fleet.train_step(inputs, targets, nn.MSELoss())
state, _ = fleet.strategy.state_dicts()
if fleet.is_main:
    print("name", fleet.strategy.name, "samples", sorted(set(seen)))
    torch.save({k: v.detach().clone() for k, v in state.items()}, out)
fleet.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, out, degrees: list[str], processes: int):
    port, procs = _free_port(), []
    for rank in range(processes):
        env = clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src")]))
        if processes > 1:
            env |= dict(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes), LOCAL_WORLD_SIZE=str(processes),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(tmp_path / "job.py"), str(out), *degrees],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    outputs = read_outputs(procs, timeout=240)
    codes = [p.returncode for p in procs]
    assert codes == [0] * processes, said(codes, dict(enumerate(outputs)))
    return outputs[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dimension_declared_by_a_newcomer_trains_to_serials_weights(tmp_path):
    (tmp_path / "declared_ext").mkdir()
    (tmp_path / "declared_ext" / "__init__.py").write_text("")
    (tmp_path / "declared_ext" / "halves.py").write_text(textwrap.dedent(EXTENSION))
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    assert "name serial samples [16]" in _run(tmp_path, tmp_path / "serial.pt", [], 1)
    serial = torch.load(tmp_path / "serial.pt")
    for degrees, name in ((["dp_shard=2"], "fsdp+halves"), (["dp_replicate=2"], "dp_replicate+halves")):
        out = tmp_path / f"{name}.pt"
        said_first = _run(tmp_path, out, degrees, 4)
        assert f"name {name} samples [4]" in said_first, said_first  # 16 a step, over 2 readers, cut in 2
        weights = torch.load(out)
        assert weights.keys() == serial.keys()
        gap = max((weights[k] - serial[k]).abs().max().item() for k in serial)
        moved = max((serial[k] - 0).abs().max().item() for k in serial)
        assert gap < 1e-6 and moved > 0, (name, gap)
