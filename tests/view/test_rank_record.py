"""The per-rank record is declared once (view/record.py): the gathered vector, the metrics files' columns, the
terminal table, the page's charts and the straggler rules' phases all come from its fields, so a field added
there reaches every one of them, and no other module lists the fields."""

import ast
import csv
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT
from torchfleet.run_services import metrics, stragglers
from torchfleet.view import figures, record, rows
from torchfleet.view.record import RankWindow, figure

PACKAGE = ROOT / "src" / "torchfleet"


@dataclasses.dataclass(frozen=True)
class Wider(RankWindow):
    """A record with one more field, sending a number of its own: its square, whose root the record holds."""

    grad_norm: float | None = figure(None, sends=("grad_sq",), derive=lambda mine, _: math.sqrt(mine["grad_sq"]))


MEASURED = {"steps": 2, "data": 0.1, "compute": 0.2, "comm": 0.04, "memory": 3 << 20}
MACHINE = {"cpu_s": 0.5, "wait_s": 0.02, "busy_s": 1.5, "wall_s": 1.0, "cores": 4}


def test_a_field_that_sends_a_number_widens_the_gathered_vector_and_is_read_back():
    assert record.sent() == (
        "steps",
        "data",
        "compute",
        "comm",
        "memory",
        "wait_s",
        "cpu_s",
        "busy_s",
        "wall_s",
        "cores",
    )
    vector = record.pack({**MEASURED, **MACHINE, "grad_sq": 9.0}, Wider)
    assert len(vector) == len(record.sent()) + 1 and vector[-1] == 9.0
    with pytest.raises(ValueError, match=r"measure what its fields send"):
        record.pack({**MEASURED, **MACHINE}, Wider)  # the number the new field sends was not measured
    (mine,) = record.windows(6, [vector], ["h"], "rss", Wider)
    assert mine.grad_norm == 3.0 and isinstance(mine, Wider)
    assert (mine.step, mine.rank, mine.host, mine.steps, mine.memory_kind) == (6, 0, "h", 2, "rss")
    assert (mine.data_s, mine.compute_s, mine.comm_s) == pytest.approx((0.05, 0.1, 0.02))
    assert mine.step_s == pytest.approx(0.17) and mine.cpu_wait_s == pytest.approx(0.01)
    assert mine.others_cores == pytest.approx(1.0) and mine.host_cores == 4 and mine.memory_bytes == 3 << 20
    assert list(mine.row()) == [*RankWindow.__dataclass_fields__, "grad_norm"]


def test_the_consumers_read_the_declaration():
    assert metrics.RANK_COLUMNS == tuple(f.name for f in dataclasses.fields(RankWindow))[1:]
    assert stragglers.PHASES == {"data": "data_s", "compute": "compute_s", "communication": "comm_s"}
    assert figures.CHARTS == ("step", "phases", "memory", "groups")
    assert rows.RANK_FIELDS == (
        "step",
        "rank",
        "host",
        "steps",
        "data_s",
        "compute_s",
        "comm_s",
        "step_s",
        "memory_bytes",
    )


def test_no_other_module_lists_the_records_fields():
    """A tuple, list, set or dict literal (with what it holds: pairs in a tuple) naming two of the record's measured fields (those with a unit: the
    identities step, rank and host are every row's) anywhere else is a second list."""
    names = {name for name, how in record.figures().items() if how.unit}
    assert names >= {"data_s", "compute_s", "comm_s", "step_s", "memory_bytes"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "view" / "record.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                named = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names}
                if len(named) > 1:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {sorted(named)}")
    assert found == []


# A field derived from a number every rank already sends: its CPU time per step.
NEW_FIELD = """
    own_cpu_s: float | None = figure(
        None, sends=("cpu_s",), derive=_per_step("cpu_s"), unit="s", column="cpu ms", place=5.5, chart=("cpu", "CPU time per rank")
    )
"""
# One rank's real PhaseClock over three steps, its window written, tabled and charted as the main rank does.
SCRIPT = """
import io, json, sys, torch
from rich.console import Console
from torchfleet.run_services.metrics import MetricsLog, RANK_SCALARS
from torchfleet.run_services.rank_figures import PhaseClock, windows
from torchfleet.view import figures, rows
from torchfleet.view.table import RankTable

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
clock = PhaseClock(model, optimizer, torch.device("cpu"))
for batch in clock.batches([torch.randn(8, 4)] * 3):
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    clock.trained()
sent = clock.take()
records = windows(3, [sent, sent], ["h", "h"], "rss")
with MetricsLog(sys.argv[1], per_rank=True) as log:
    log.step(3, 1, 0.5, 0.1, 24)
    log.ranks(records)
console = Console(record=True, width=200, color_system=None, file=io.StringIO())
table = RankTable(console=console)
table.update([r.row() for r in records])
console.print(table)
run = rows.read_metrics(__import__("pathlib").Path(sys.argv[1]))
drawn = figures.figures(run)
print(json.dumps({"sent": sent, "row": records[0].row(), "table": console.export_text(), "scalars": RANK_SCALARS,
                  "charts": list(drawn), "read": run.latest()[0],
                  "cpu_chart": [list(t.y) for t in drawn["cpu"].data] if "cpu" in drawn else None}))
"""


@pytest.mark.timeout(120)
def test_a_field_added_to_the_declaration_alone_reaches_the_files_the_table_and_the_page(tmp_path):
    """The change trace of a new per-rank figure: one edit, to record.py, in a copy of the package."""
    copy = tmp_path / "src" / "torchfleet"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    declared = copy / "view" / "record.py"
    anchor = "    def row(self) -> dict:\n"
    assert declared.read_text().count(anchor) == 1
    declared.write_text(declared.read_text().replace(anchor, NEW_FIELD + "\n" + anchor))

    out = tmp_path / "metrics.csv"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "src")},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # The gathered vector is as wide as before (the field sends a number already sent), and the record holds it.
    cpu_s = seen["sent"][record.sent().index("cpu_s")]
    assert len(seen["sent"]) == len(record.sent()) and cpu_s > 0
    assert seen["row"]["own_cpu_s"] == pytest.approx(cpu_s / 3)
    # The metrics file: the new column after the record's others, before the verdicts'; its value in each row.
    header = next(csv.reader(out.open()))
    assert header == [*metrics.TRAIN_COLUMNS, *metrics.RANK_COLUMNS, "own_cpu_s", *metrics.VERDICT_COLUMNS]
    ranks = [r for r in csv.DictReader(out.open()) if r["kind"] == "rank"]
    assert [float(r["own_cpu_s"]) for r in ranks] == pytest.approx([cpu_s / 3] * 2)
    assert seen["read"]["own_cpu_s"] == pytest.approx(cpu_s / 3)  # read back as a number
    assert seen["scalars"] == ["data_s", "compute_s", "comm_s", "step_s", "memory_bytes", "own_cpu_s"]
    # The table: its column at its place, between communication and memory, in milliseconds.
    (titles,) = [line for line in seen["table"].splitlines() if "rank" in line and "host" in line]
    assert [t.strip() for t in titles.strip("┃│ ").split("┃")][-4:] == ["comm ms", "cpu ms", "memory", "straggler"]
    assert f"{cpu_s / 3 * 1e3:.1f}" in seen["table"]
    # The page: its chart at its place, each rank's line in milliseconds.
    assert seen["charts"] == ["step", "phases", "cpu", "memory", "groups"]
    assert seen["cpu_chart"] == [pytest.approx([cpu_s / 3 * 1e3])] * 2
