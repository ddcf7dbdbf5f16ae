"""What a healing group takes from a live peer: this rank's share of the training state.

torchft's transport sends whatever the state function returns (here over the
replica groups' own process group, `PGTransport`) and hands it to the load
function on the healing side. Every group runs the same model under the same
strategy on the same number of processes, so rank r of one group holds
exactly the shards rank r of another holds: the state travels as this rank's
local tensors, in the order of the model's parameters, and is copied into the
healing rank's own tensors in place. A layout that differs (another model,
strategy or group size) is refused, never copied by position.

The state function runs on torchft's quorum thread while the main thread may
be in a forward pass, so it reads objects captured at set-up: the parameters
as the strategy sharded them (FSDP2 swaps a module's parameters for unsharded
ones during forward; the sharded ones stay put) and the optimizer's state,
which only the optimizer step changes, and that waits for the quorum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchfleet.errors import TrainingError


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TrainingState:
    """The state functions torchft's Manager calls: `state()` on a live peer, `load()` on a healing group."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision=None):
        self.optimizer = optimizer
        self.precision = precision  # its GradScaler state travels too (fp16)
        self.params = list(model.named_parameters())
        self.buffers = list(model.named_buffers())
        self.stepped = [p for group in optimizer.param_groups for p in group["params"]]

    def layout(self) -> list[str]:
        """Names and local shapes, in order: what both sides must agree on."""
        return [f"{name}{tuple(_local(t).shape)}" for name, t in self.params + self.buffers]

    def state(self) -> dict[str, Any]:
        return {
            "layout": self.layout(),
            "params": [_local(p).detach() for _, p in self.params],
            "buffers": [_local(b) for _, b in self.buffers],
            "optimizer": [
                {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in self.optimizer.state.get(p, {}).items()}
                for p in self.stepped
            ],
            "hyper": [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups],
            "scaler": self.precision.state_dict() if self.precision is not None else {},
        }

    @torch.no_grad()
    def load(self, state: dict[str, Any], source: str = "the peer") -> None:
        mine = self.layout()
        if state["layout"] != mine:
            first = next(
                (f"{a} here, {b} there" for a, b in zip(mine, state["layout"], strict=False) if a != b),
                f"{len(mine)} tensors here, {len(state['layout'])} there",
            )
            raise TrainingError(
                f"this group cannot take {source}'s weights: their layouts differ ({first});"
                " every group must run the same model, strategy and number of processes"
            )
        for (_, p), value in zip(self.params, state["params"], strict=True):
            _local(p).copy_(value)
        for (_, b), value in zip(self.buffers, state["buffers"], strict=True):
            _local(b).copy_(value)
        for group, hyper in zip(self.optimizer.param_groups, state["hyper"], strict=True):
            group.update(hyper)
        for p, entries in zip(self.stepped, state["optimizer"], strict=True):
            if entries:
                self.optimizer.state[p] = {k: self._as_state(p, k, v) for k, v in entries.items()}
            else:
                self.optimizer.state.pop(p, None)
        if self.precision is not None:
            self.precision.load_state_dict(state["scaler"])

    def _as_state(self, param: torch.Tensor, key: str, value):
        """An optimizer-state entry as the optimizer keeps it: a DTensor beside a DTensor parameter,
        its step counter where torch's optimizers keep it (on the CPU unless capturable or fused)."""
        if not isinstance(value, torch.Tensor):
            return value
        if key == "step" and value.dim() == 0:
            group = next(g for g in self.optimizer.param_groups if any(p is param for p in g["params"]))
            on_device = group.get("capturable") or group.get("fused")
            return value.clone().to(param.device if on_device else "cpu")
        value = value.to(param.device).clone()
        if isinstance(param, DTensor) and value.shape == _local(param).shape:
            return DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        return value
