"""notebook_launch from a real Jupyter kernel: examples/ddp_notebook.ipynb, executed by nbclient.

The notebook defines its training function in the kernel's __main__ and trains digits
with DDP on 2 processes; its last cell prints each rank's validation accuracy.
"""

from __future__ import annotations

import re

import pytest

from helpers import EXAMPLES, clean_env, require_module
from torchfleet import UsageError, notebook_launch

nbformat = require_module("nbformat", "nbformat is in the dev extra")
nbclient = require_module("nbclient", "nbclient is in the dev extra")
require_module("ipykernel", "ipykernel is in the dev extra")


@pytest.mark.timeout(300)
def test_the_example_notebook_trains_ddp_in_a_real_kernel(monkeypatch):
    for name, value in clean_env().items():  # the kernel must not look like a rank itself
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    notebook = nbformat.read(EXAMPLES / "ddp_notebook.ipynb", as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()
    out = "".join(o.get("text", "") for o in notebook.cells[-1].outputs)
    found = re.findall(r"rank (\d) of (\d): validation accuracy ([\d.]+)", out)
    assert [(rank, world) for rank, world, _ in found] == [("0", "2"), ("1", "2")], out
    accuracies = {float(a) for _, _, a in found}
    assert len(accuracies) == 1  # one model, evaluated once over both ranks' shards
    assert accuracies.pop() > 0.9


def test_cuda_touched_before_launch_is_refused(monkeypatch):
    import torch

    # Simulated: this machine may have no GPU. Only the check's input is replaced.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(UsageError, match="CUDA was initialised in this kernel before notebook_launch"):
        notebook_launch(print, nprocs=2)
