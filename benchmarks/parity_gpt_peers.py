"""Accelerate and Lightning Fabric as contenders of the gpt parity (benchmarks/parity_gpt_worker.py).

Each maker takes the strategy ("ddp" or "fsdp"), a fresh copy of the model, the optimizer
factory and an iterator of this rank's batches, and returns (step, weights) as the worker's own
ways do: `step()` trains one step, `weights()` gives the full weights by the model's names
(a collective under fsdp: every rank calls it). The peers read the very batches the hand-written
loop reads, not a DataLoader of their own, so that every contender sees the same global batches.

The APIs, with accelerate 1.15 and lightning 2.6 (what `make .venv/.parity` installs here):

- Accelerate, ddp: `Accelerator(cpu=True)` and `prepare(model, optimizer)`: DistributedDataParallel.
- Accelerate, fsdp: `FullyShardedDataParallelPlugin(fsdp_version=2,
  auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])`, so
  `prepare` runs Accelerate's FSDP2 route (`fsdp2_prepare_model`: `fully_shard` on each Block,
  the final norm as a unit of its own kept gathered, then the root, which holds the embeddings
  and the head: it finds no `get_output_embeddings` on this model). Accelerate picks FSDP only
  on an accelerator device: with `cpu=True` it takes the plugin and silently wraps the model in
  DDP. So the state is set to FSDP by hand (`_force_fsdp`), which is what Accelerate itself does
  on a GPU; everything after that is Accelerate's own code.
- Fabric, ddp: `Fabric(accelerator="cpu", strategy="ddp")`, then `setup(model, optimizer)`.
- Fabric, fsdp: `ModelParallelStrategy(parallelize_fn)`, Fabric's FSDP2 route (its
  `FSDPStrategy` is FSDP1's `FullyShardedDataParallel`); `parallelize_fn` applies `fully_shard`
  on each block, then the root, over the mesh's data-parallel dimension, as the hand-written way
  does. The optimizer is made after sharding (`setup_module`, then `setup_optimizers`), since
  `fully_shard` replaces the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from torchfleet.models.gpt import GPT, lm_loss

Step = Callable[[], None]
Weights = Callable[[], dict]
# ways that have no pipeline strategy: the report shows "—" for them under pipeline
PEERS = ("accelerate", "fabric")


def full_weights(net: nn.Module) -> dict:
    """The whole model's weights on rank 0 (FSDP2's shards gathered); a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _step(backward: Callable, model, optimizer, batches: Iterator) -> Step:
    """One training step through a peer's own backward (its loss scaling and hooks)."""

    def step():
        x, y = next(batches)
        optimizer.zero_grad()
        backward(lm_loss(model(x), y))
        optimizer.step()

    return step


def _force_fsdp(accelerator, plugin) -> None:
    """Make Accelerate take its FSDP route on CPU, where it would otherwise fall back to DDP."""
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def accelerate_way(strategy: str, net: GPT, optimizer_for: Callable, batches: Iterator) -> tuple[Step, Weights]:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    if strategy == "fsdp":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[type(net.blocks[0]).__name__],
        )
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        _force_fsdp(accelerator, plugin)
    else:
        accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(net, optimizer_for(net.parameters()))
    step = _step(accelerator.backward, model, optimizer, batches)
    # Under ddp `net` is the module inside DistributedDataParallel; under fsdp, sharded in place.
    return step, (lambda: full_weights(model)) if strategy == "fsdp" else net.state_dict


def _shard_blocks(model: GPT, mesh) -> GPT:
    """Fabric's parallelize_fn: fully_shard each block, then the root, as the hand-written fsdp."""
    from torch.distributed.fsdp import fully_shard

    data_parallel = mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=data_parallel)
    fully_shard(model, mesh=data_parallel)  # in place: the module itself, now sharded
    return model


def fabric_way(strategy: str, net: GPT, optimizer_for: Callable, batches: Iterator) -> tuple[Step, Weights]:
    from lightning.fabric import Fabric

    world = dist.get_world_size()
    if strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        fabric = Fabric(
            accelerator="cpu",
            devices=world,
            strategy=ModelParallelStrategy(_shard_blocks, data_parallel_size=world, tensor_parallel_size=1),
        )
        fabric.launch()  # under torchrun: joins the running processes, starts none
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(optimizer_for(model.parameters()))
        assert not isinstance(optimizer, tuple)  # one optimizer in, one out
    else:
        fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
        fabric.launch()
        model, optimizer = fabric.setup(net, optimizer_for(net.parameters()))
    return _step(fabric.backward, model, optimizer, batches), (
        lambda: full_weights(net)
    ) if strategy == "fsdp" else net.state_dict


MAKERS: dict[str, Callable[..., tuple[Step, Weights]]] = {"accelerate": accelerate_way, "fabric": fabric_way}


def make(
    name: str, strategy: str, net: GPT, optimizer_for: Callable, batches: Iterator
) -> tuple[tuple[Step, Weights] | None, str]:
    """One peer's (step, weights), or None and one line saying why not: not installed, or it failed
    to set up. Every rank must agree (a peer that one rank drops would hang the other in a
    collective), so the ranks compare notes and drop it everywhere if it failed anywhere."""
    try:
        made, why = MAKERS[name](strategy, net, optimizer_for, batches), ""
    except ModuleNotFoundError as e:
        made, why = None, f"not installed (no module {e.name})"
    except Exception as e:  # noqa: BLE001 - any failure of a peer is reported, and the others go on
        made, why = None, f"failed to set up: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, why)
    why = next((r for r in reasons if r), "")
    return (None if why else made), why


@torch.no_grad()
def largest_difference(a: dict, b: dict) -> tuple[float, int]:
    """The largest absolute difference between two sets of weights over the names both have, and how many."""
    common = [n for n in a if n in b]
    worst = max((a[n].float().cpu() - b[n].float().cpu()).abs().max().item() for n in common)
    return worst, len(common)
