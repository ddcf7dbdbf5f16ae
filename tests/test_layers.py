"""The architecture as a test: each module imports only its own layer and those below, no cycles.

Imports inside functions count: one that reaches up a layer, or closes a
cycle, is the same coupling as one at the top of the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGE = ROOT / "src" / "torchfleet"
# Bottom to top. A module may import its own layer and the layers below it. An entry names a package
# or a module under the package root; a dotted entry ("testing.cli") places one module of a feature's
# package on a higher layer than the rest of it, so a feature can live in one room and still be layered.
LAYERS = [
    # no torch knowledge needed
    ("errors", "versions", "installed", "outputs", "allocator", "netif", "config", "machine_load"),
    # what a process finds, core rules, built-in models, tensor memory
    ("env", "backend", "precision", "memory_format", "data", "models", "tensor_memory", "stores"),
    # how a model is wrapped; the parallel dimensions; diloco's and localsgd's options (no torch)
    ("strategies", "replica_groups.sync_methods", "hogwild.worker"),
    ("checkpoint", "weights"),  # verified directories, DCP; meta models, weights read and written by shards
    # replica groups on torchft: the lighthouse, per-step fault tolerance, the outer step, N groups on one machine
    ("replica_groups",),
    ("launcher", "hogwild.runner"),  # starting processes, reading back their failures
    ("worker",),  # what runs inside the training processes: preemption, the hang watchdog, a script's entry
    ("view",),  # the live table, the --dashboard page and report's: plain rows in, no torch
    ("run_services",),  # per-rank figures, straggler verdicts, the metrics files: what Fleet and train offer
    ("fleet", "hogwild", "strategy_spec"),  # the API a script holds; what a strategy name comes to
    ("doctor", "train"),  # the machine report; the built-in job, hogwild's and replica groups' runs of it
    ("testing", "bench"),  # reference jobs; the strategy matrix
    ("plan", "verify"),  # predictions per strategy, checked against bench's cells; each strategy against serial
    ("clusters",),  # job writers for schedulers
    ("cli", "__main__", "testing.cli"),  # the commands; the command line run for tests
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runs(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under ``if TYPE_CHECKING:``, which never run: the package
    root names what it loads lazily there for type checkers (its __getattr__ imports them)."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def _imports(path: Path, module: str) -> set[str]:
    """Every torchfleet module `path` imports when it runs, anywhere in the file."""
    found = set()
    for node in _runs(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torchfleet."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchfleet"):
            for alias in node.names:  # `from torchfleet.x import y`: y may be a module of x
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
    return {m for m in found if m != module}


MODULES = {_module(p) for p in PACKAGE.rglob("*.py")}
GRAPH = {_module(p): _imports(p, _module(p)) for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int:
    """The layer of the longest entry of LAYERS that `module` is, or is inside."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if (entry := ".".join(parts[:n])) in LAYER_OF:
            return LAYER_OF[entry]
    pytest.fail(f"{module} is in no layer: add its package to LAYERS in {Path(__file__).name}")


def test_every_module_has_a_layer():
    for module in GRAPH:
        if module != "torchfleet":  # the package root is the public facade; it loads lazily
            _layer(module)


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if m != "torchfleet"
        for t in sorted(targets)
        if t != "torchfleet" and _layer(t) > _layer(m)
    ]
    assert upward == []


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_modules_stay_small():
    long = {_module(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
