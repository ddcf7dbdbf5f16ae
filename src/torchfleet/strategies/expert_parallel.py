"""Expert parallelism: a mixture-of-experts layer's experts split over ranks, tokens sent to theirs.

A module holding experts stacks one matrix per expert in each weight (transformers 5's MoE
models: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]; the built-in gpt-moe the same), and
is called with each token's chosen experts: ``experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]``. Under ep each rank of a group of ``ep`` keeps E / ep experts
(DTensors sharded on dim 0 over the mesh's "ep" dimension), and the module's forward becomes:

1. sort this rank's (token, choice) pairs by expert and tell every rank of the group how many
   it will get for each of its experts (one small all-to-all of counts);
2. send each token to its experts' rank (all-to-all, torch's autograd-aware one, so the
   backward sends the gradients back the same way);
3. run the module's own forward on what arrived, over the local experts only (its weights
   swapped for their local shards), each row weighted 1;
4. send the results back (all-to-all), weight them by the router's scores and sum each
   token's choices, as the module itself does.

No token is dropped (no capacity limit), so the step computes serial's function.

Gradients: an expert's gradient on its rank sums what every rank of the group sent it, each
from its own batch's mean loss, where data parallelism averages. So the local weights pass
through a gradient scale of 1 / ep, and FSDP2 (or the replicas' average) does the rest
over "dp_mod_ep": the sum becomes the mean over every data-parallel rank, as serial's.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.utils.stateless import _reparametrize_module

from torchfleet.errors import UsageError
from torchfleet.strategies.registry import EP, TP


def _stacked(module: nn.Module) -> int | None:
    """How many experts `module` stacks: its `num_experts`, where every weight of its own is 3-D with that many
    matrices (a router's 2-D weight does not count), else None."""
    count = getattr(module, "num_experts", None)
    own = [p for _, p in module.named_parameters(recurse=False)]
    if isinstance(count, int) and own and all(p.dim() == 3 and p.shape[0] == count for p in own):
        return count
    return None


def find_experts(model: nn.Module, classes: tuple[str, ...] | None = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module holding experts: those of the `classes` named, else those found."""
    found = []
    for name, module in model.named_modules():
        if classes is not None and type(module).__name__ not in classes:
            continue
        if classes is not None:
            own = [p for _, p in module.named_parameters(recurse=False)]
            if not own or len({p.shape[0] for p in own}) != 1 or any(p.dim() < 2 for p in own):
                raise UsageError(
                    f"--experts {type(module).__name__}: {name} does not stack one matrix per expert in its"
                    " weights (each weight's first dimension the number of experts); name the class that does"
                )
            found.append((name, module))
        elif _stacked(module):
            found.append((name, module))
    return found


def check_experts(model: nn.Module, ep: int, classes: tuple[str, ...] | None = None) -> list[tuple[str, nn.Module]]:
    """The modules ep splits, refused in one sentence when there are none or `ep` does not divide theirs."""
    experts = find_experts(model, classes)
    if not experts:
        how = f"of the classes {', '.join(classes)}" if classes else "whose weights stack one matrix per expert"
        raise UsageError(
            f"ep({ep}): {type(model).__name__} has no experts to split (no module {how}); use a"
            " mixture-of-experts model, name its experts' class with --experts, or a strategy without ep"
        )
    for name, module in experts:
        count = _count(module)
        if count % ep:
            raise UsageError(
                f"--ep {ep} does not divide the {count} experts of {name} ({type(module).__name__});"
                f" choose a divisor of {count}"
            )
    return experts


def expert_note(experts: list[tuple[str, nn.Module]], dims) -> str:
    """What ep did, for the run's notes: how many experts each rank holds of how many layers'."""
    count = _count(experts[0][1])
    where = "replicated" if dims.dp_shard == 1 else "sharded by FSDP2"
    across = f", {where} over dp_mod_ep({dims.dp // dims.ep})" if dims.dp > dims.ep else ""
    return (
        f"{dims.name} splits the {count} experts of {len(experts)} layers ({type(experts[0][1]).__name__}) over"
        f" ep({dims.ep}) processes, {count // dims.ep} each{across}; tokens reach them by all-to-all"
    )


def _count(module: nn.Module) -> int:
    return next(module.parameters(recurse=False)).shape[0]


def apply_ep(experts: list[tuple[str, nn.Module]], mesh: DeviceMesh) -> None:
    """Split each module's experts over `mesh`'s "ep" dimension and route its tokens to them.

    Beside tp (`mesh` with a "tp" dimension, the experts already split over it, or left whole, by the plan),
    each rank keeps its ep share of what tp gave it, and each tp column routes among its own ep group."""
    ep_mesh = mesh[EP]
    # A full state dict gathers each expert weight over both of the experts' mesh dimensions, which DTensor
    # warns, every save, may take two all-gathers; that is the expected cost, not a fault to report.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    beside_tp = TP in (mesh.mesh_dim_names or ())
    for _, module in experts:
        for name, param in list(module.named_parameters(recurse=False)):
            shard = _beside_tp(param.data, mesh) if beside_tp else distribute_tensor(param.data, ep_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        _route(module, ep_mesh.get_group(), ep_mesh.size())


def _beside_tp(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`tensor` (tp's DTensor, or a whole one the plan left whole) as a DTensor of `mesh`'s ("ep", "tp"): its
    experts split over "ep", each rank's part over "tp" as tp placed it. The ep share is scattered from the first
    rank of each column's ep group, as without tp, so the group holds one set of experts."""
    if isinstance(tensor, DTensor):
        local, over_tp = tensor.to_local(), tensor.placements[0]
    else:
        local, over_tp = tensor, Replicate()
    mine = distribute_tensor(local, mesh[EP], [Shard(0)]).to_local()
    return DTensor.from_local(
        mine, mesh[EP, TP], [Shard(0), over_tp], run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose gradient is scaled: the experts' 1 / ep (see the module's docstring)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


@contextlib.contextmanager
def _count_of(module: nn.Module, local: int):
    """`num_experts` set to the local experts' count while the module's own forward runs over them."""
    had = getattr(module, "num_experts", None)
    if had is None:
        yield
        return
    setattr(module, "num_experts", local)  # noqa: B010 (nn.Module's typed __setattr__ takes tensors and modules)
    try:
        yield
    finally:
        setattr(module, "num_experts", had)  # noqa: B010


def _exchange(rows: torch.Tensor, receive: list[int], send: list[int], group) -> torch.Tensor:
    """`rows` split by `send` to the group's ranks, what they sent by `receive` back: torch's all-to-all whose
    backward is the all-to-all the other way (its functional collectives; torch.distributed.nn's is deprecated)."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), receive, send, group))


def _balanced(chosen: torch.Tensor, total: int, ep: int, group) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """(order, arriving, send, receive) as `_route` finds them, for choices spread evenly over the experts, every
    rank of the group choosing alike: what plan's memory trace routes, whose fake choices have no values."""
    rows = chosen.numel()
    counts = [rows // total + (1 if e < rows % total else 0) for e in range(total)]
    local = total // ep
    mine = dist.get_group_rank(group, dist.get_rank()) * local
    send = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]
    arriving = torch.tensor(counts[mine : mine + local] * ep, device=chosen.device)  # [source rank, local expert]
    return torch.arange(rows, device=chosen.device), arriving, send, [send[mine // local]] * ep


def _route(module: nn.Module, group, ep: int) -> None:
    own_forward = module.forward  # the module's (or the library's dispatching) forward, bound

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        total = _count(module)
        local = total // ep
        tokens, k = top_k_index.shape
        chosen = top_k_index.reshape(-1)
        if is_fake(chosen):  # plan's memory trace: no values to route by, each expert takes an even share
            order, arriving, send, receive = _balanced(chosen, total, ep, group)
        else:
            order = torch.argsort(chosen, stable=True)  # (token, choice) pairs by expert, so by rank
            counts = torch.bincount(chosen, minlength=total)
            arriving = torch.empty_like(counts)  # [source rank, local expert]
            dist.all_to_all_single(arriving, counts, group=group)
            send = counts.view(ep, local).sum(1).tolist()
            receive = arriving.view(ep, local).sum(1).tolist()
        token_of = order // k
        arrived = _exchange(hidden_states[token_of], receive, send, group)
        local_index = (
            torch.arange(local, device=chosen.device).repeat(ep).repeat_interleave(arriving, output_size=sum(receive))
        )
        weights = {
            name: _ScaleGrad.apply(p.to_local() if isinstance(p, DTensor) else p, 1.0 / ep)
            for name, p in module.named_parameters(recurse=False)
        }
        ones = torch.ones(len(local_index), 1, dtype=top_k_weights.dtype, device=arrived.device)
        with _reparametrize_module(module, weights), _count_of(module, local):
            done = own_forward(arrived, local_index[:, None], ones)
        if not len(local_index):
            # Nothing arrived: the result holds no path to the arrivals or the weights, yet every rank of the
            # group must run the backward's all-to-all, and FSDP2 reduce the weights' gradient, with the others.
            done = done + 0.0 * (arrived.sum() + sum(w.reshape(-1)[0] for w in weights.values()))
        back = _exchange(done, send, receive, group)
        scores = top_k_weights.reshape(-1)[order].unsqueeze(1)
        combined = hidden_states.new_zeros(tokens, hidden_states.shape[1])
        return combined.index_add(0, token_of, (back * scores).to(combined.dtype))

    module.forward = forward
