"""Tokens per expert, said at the end of any Fleet script's run, summed over every rank's tokens."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import on_two_ranks, torchfleet
from torchfleet.models import gpt_moe
from torchfleet.strategies.expert_load import ExpertLoad

SCRIPT = """
import torch
from torchfleet import Fleet
from torchfleet.models import gpt_moe, lm_loss

fleet = Fleet("ddp")
torch.manual_seed(0)
model = gpt_moe("tiny")
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step routes as the first
model, optimizer = fleet.setup(model, optimizer)
tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
mine = tokens[4 * fleet.rank : 4 * (fleet.rank + 1)]  # each rank its half of the global batch
for _ in range(2):
    fleet.train_step(mine[:, :-1], mine[:, 1:], lm_loss)
fleet.close()
"""


@pytest.mark.timeout(180)
def test_a_fleet_script_says_each_experts_share_of_every_ranks_tokens(tmp_path):
    script = tmp_path / "moe_script.py"
    script.write_text(SCRIPT)
    result = torchfleet("run", "-n", "2", str(script), timeout=160)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("torchfleet: tokens per expert: ")]
    assert len(lines) == 1, result.stdout  # the main rank says it, once
    said = [float(x) / 100 for x in re.findall(r"e\d+ (\d+\.\d)%", lines[0])]
    # What one process routes over the whole global batch with the same weights: the sum of both ranks' halves.
    torch.manual_seed(0)
    model = gpt_moe("tiny")
    load = ExpertLoad(model)
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(tokens[:, :-1])
    want = load.shares(torch.device("cpu"))
    assert want is not None and len(said) == len(want) == 8
    assert max(abs(a - b) for a, b in zip(said, want, strict=True)) <= 0.0006, (said, want)
    load.counts, load.taken = None, False
    with torch.no_grad():
        model(tokens[:4, :-1])  # rank 0's half alone
    alone = load.shares(torch.device("cpu"))
    assert alone is not None and max(abs(a - b) for a, b in zip(alone, want, strict=True)) > 0.002  # tells them apart


def _shares_on(rank: int, init: str, found, counts: list[int] | None) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        load = ExpertLoad(torch.nn.Module())  # no experts to hook: the counts are set by hand
        load.counts = None if counts is None else torch.tensor(counts)
        found.put((rank, load.shares(torch.device("cpu"))))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", [[0, 2, 4, 2], None])  # None: rank 1 holds no experts (another stage's)
def test_the_shares_are_summed_over_every_rank(tmp_path, second):
    counts = [[6, 2, 0, 0], second]
    said = on_two_ranks(_shares_on, tmp_path, lambda rank: (counts[rank],))
    total = [a + b for a, b in zip(counts[0], second or [0, 0, 0, 0], strict=True)]
    want = [c / sum(total) for c in total]  # every rank's tokens, not rank 0's own (sixteenths: exact)
    assert said == {0: want, 1: want}
