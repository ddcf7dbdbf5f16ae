"""The run's services in a user's own Fleet script under `torchfleet run`: each rank's phases in the metrics file
and on the --dashboard page, and a rank slowed in its data set named with its phase, as `torchfleet train` names
one (test_stragglers.py), with no line for them in the script."""

import json
import socket

import pytest
import torch

from helpers import require_module, torchfleet
from torchfleet.run_services import in_fleet

# rank 1 sleeps SLOW seconds per sample in __getitem__: 8 samples a step, 20 ms more data time a step.
SCRIPT = """
import sys
import time

import torch
from torch.utils.data import Dataset

from torchfleet import Fleet

SLOW = float(sys.argv[1])


class Samples(Dataset):
    def __init__(self, rank):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(4096, 32, generator=generator), torch.randint(0, 4, (4096,), generator=generator)
        self.rank = rank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.rank == 1 and SLOW:
            time.sleep(SLOW)
        return self.x[i], self.y[i]


fleet = Fleet("ddp")
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
model, optimizer = fleet.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step, (x, y) in enumerate(fleet.dataloader(Samples(fleet.rank), batch_size=16), 1):
    fleet.train_step(x, y, torch.nn.functional.cross_entropy)
    if step == 20:
        break
fleet.close()
"""


def _run(tmp_path, slow: float, *flags: str):
    script, out = tmp_path / "own_script.py", tmp_path / "metrics.jsonl"
    script.write_text(SCRIPT)
    done = torchfleet("run", "-n", "2", "--log-every", "2", "--metrics-out", str(out), *flags, str(script), str(slow))
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], done


@pytest.mark.timeout(150)
def test_a_fleet_script_names_the_rank_slowed_in_its_data_set(tmp_path):
    rows, done = _run(tmp_path, 0.0025)
    verdicts = [r for r in rows if r["kind"] == "straggler"]
    assert [(v["rank"], v["phase"]) for v in verdicts] == [(1, "data")], verdicts
    (verdict,) = verdicts
    assert verdict["step"] <= 20  # named within 20 steps
    assert verdict["message"] in done.stdout and f"rank 1 (host {verdict['host']}) is slow in data" in done.stdout
    ranks = [r for r in rows if r["kind"] == "rank"]
    assert sorted({r["rank"] for r in ranks}) == [0, 1] and {r["step"] for r in ranks} == set(range(2, 21, 2))
    last = {r["rank"]: r for r in ranks if r["step"] == 20}
    assert last[1]["data_s"] >= 0.02 > last[0]["data_s"]  # 8 samples of 2.5 ms a step
    assert last[0]["comm_s"] > last[1]["comm_s"]  # rank 0 waited for it at the gradient sync


@pytest.mark.timeout(150)
def test_an_unslowed_fleet_script_names_nobody_and_its_page_has_every_rank(tmp_path):
    require_module("plotly", "the page's charts need plotly (pip install 'torchfleet[dashboard]')")
    require_module("bottle", "the dashboard's server needs bottle (pip install 'torchfleet[dashboard]')")
    rows, done = _run(tmp_path, 0.0, "--dashboard", "0")
    assert [r for r in rows if r["kind"] == "straggler"] == [] and "straggler" not in done.stdout
    ranks = [r for r in rows if r["kind"] == "rank"]
    assert len(ranks) == 2 * 10 and {r["rank"] for r in ranks} == {0, 1}
    for r in ranks:
        assert r["step_s"] == pytest.approx(r["data_s"] + r["compute_s"] + r["comm_s"]) and r["steps"] == 2
    page = (tmp_path / "metrics.html").read_text()  # the page as it stood at the end, beside the metrics file
    host = socket.gethostname()
    assert f"rank 0 ({host})" in page and f"rank 1 ({host})" in page and "step 20" in page


def test_the_options_travel_in_the_environment_and_one_process_gets_no_services(monkeypatch):
    options = in_fleet.RunOptions(4, "out.csv", "0")
    for name, value in options.exported().items():
        monkeypatch.setenv(name, value)
    assert in_fleet.RunOptions.from_environment() == options
    from torchfleet import Fleet

    fleet = Fleet("serial")
    model, _ = fleet.setup(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    loader = fleet.dataloader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), batch_size=4)
    assert fleet.services is None  # one process: no other rank to be slower than
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 2 and len(list(loader)) == 2
    monkeypatch.setenv(in_fleet.ON, "0")  # a user's opt-out: torchfleet run passes it on, and Fleet starts none
    assert options.exported()[in_fleet.ON] == "0" and in_fleet.RunOptions.from_environment() is None
