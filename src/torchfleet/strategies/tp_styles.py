"""transformers' tensor-parallel styles, as torch's `ParallelStyle`s that train to serial's weights.

A transformers config's ``base_model_tp_plan`` names a style per module (or
parameter) by a word. torchfleet maps every word to torch's tensor parallel
(DTensor placements and `ParallelStyle`s), so that a library model's plan, a
user's own ``tp_plan`` and the built-in gpt's all go through one
`parallelize_module`, and the planner traces the same styles. transformers 5
carries its own implementation; it is not used because it is version-bound
(transformers 4 has none), and its ``replicated_with_grad_allreduce`` sums the
*accumulated* gradient after every micro-batch, which counts early micro-batches
twice under gradient accumulation: here each micro-batch's gradient is summed as
it flows.

The words and what each does on a tp group:

- ``colwise``, ``rowwise``: Megatron's pair (torch's Colwise/RowwiseParallel).
- ``colwise_gather_output`` / ``colwise_rep``: column-wise, the output gathered
  whole (Phi-3's fused qkv and gate_up, OLMo 2's q, k and v: the module after it
  then runs on the whole activation); a gathered output is the same whichever
  rows each rank holds, so a fused projection is split as it lies.
- ``rowwise_split_input`` / ``rowwise_rep``: row-wise on a whole input, each rank
  taking its slice of it.
- ``embedding_rowwise``: the vocabulary split, lookups summed (GPT-NeoX's);
  ``embedding_colwise``: the width split, lookups gathered.
- ``replicated_with_grad_allreduce``: the module stays whole but sees only this
  rank's share of the heads (Qwen3's and Gemma 3's per-head q and k norms), so
  its parameters' gradients are summed over the group in backward.
- ``moe_tp_experts`` with ``packed_colwise`` on the experts' ``gate_up_proj`` and
  ``rowwise`` on their ``down_proj``: every expert split as an MLP is, the packed
  gate and up halves each split (so every rank holds matching slices of both),
  the partial outputs summed.
- ``mla_kv_a_proj``: DeepSeek's latent key-value projection stays whole; the part
  of its output that reaches attention directly (the rotary keys, read by this
  rank's heads only) has its gradient summed over the group.
- ``all_reduce``: the module's output summed over the group;
  ``moe_identity_expert``: its input divided by the group size (the experts'
  sum then counts it once); ``replicate``: nothing to split.

``packed_colwise`` outside an experts module, ``packed_rowwise``,
``local_params`` and ``sequence_parallel`` are refused by name (STYLES_REFUSED).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from torchfleet.errors import UsageError

# The parameter-level words an experts module's own style consumes (and what it checks they are).
EXPERT_PARAMS = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
STYLES_REFUSED = {
    "packed_rowwise": "an expert layout whose gate and up halves are split by input features",
    "local_params": "attention sinks held as bare parameters",
    "sequence_parallel": "sequence-parallel norms, whose neighbours would have to hand over sequence shards",
}


class _SumBackward(torch.autograd.Function):
    """Identity forward; the gradient summed over `group` in backward (each rank's is a part)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumForward(torch.autograd.Function):
    """The tensor summed over `group` in forward (each rank holds a part); identity backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@contextlib.contextmanager
def _params_as(module: nn.Module, change):
    """`module`'s own parameters replaced, for one forward, by `change(parameter)` (what its code then reads);
    the parameters themselves stay registered (and the gradient reaches them through `change`)."""
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if param is not None:
                module._parameters[name] = change(param)
        yield
    finally:
        module._parameters.update(saved)


def _wrap_forward(module: nn.Module, around) -> nn.Module:
    forward = module.forward
    module.forward = functools.partial(around, forward)
    return module


class SumGradients(ParallelStyle):
    """replicated_with_grad_allreduce: whole parameters whose gradients are summed over the group, per
    micro-batch (as they flow, not once accumulated)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def around(forward, *args, **kwargs):
            with _params_as(module, lambda p: _SumBackward.apply(p, group) if p.requires_grad else p):
                return forward(*args, **kwargs)

        return _wrap_forward(module, around)


class SumOutput(ParallelStyle):
    """all_reduce: the module computes a part of its output on each rank; the parts are summed."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        return _wrap_forward(module, lambda forward, *a, **k: _SumForward.apply(forward(*a, **k), group))


class DivideInput(ParallelStyle):
    """moe_identity_expert: an expert that returns its input, inside experts whose outputs are summed over
    the group: divided here, so the sum counts it once."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()
        return _wrap_forward(module, lambda forward, x, *a, **k: forward(x / size, *a, **k))


class Unchanged(ParallelStyle):
    """replicate: the module stays whole on every rank, computed alike."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class LatentKeyValue(ParallelStyle):
    """mla_kv_a_proj: the projection stays whole; the last `rope_dim` features of its output go to this rank's
    heads only, so their gradient is summed over the group (the rest reaches a column-wise layer, whose own
    backward sums it)."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, rope = device_mesh.get_group(), self.rope_dim

        def around(forward, *args, **kwargs):
            out = forward(*args, **kwargs)
            kept, rotary = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([kept, _SumBackward.apply(rotary, group)], dim=-1)

        return _wrap_forward(module, around)


class ExpertsSplit(ParallelStyle):
    """moe_tp_experts (with packed_colwise gate_up_proj and rowwise down_proj): each expert split as Megatron
    splits an MLP. gate_up_proj (experts x 2 intermediate x hidden) holds the gate's rows then the up's: each
    rank takes its slice of both (a strided shard, so the checkpoint keeps the model's layout); down_proj
    (experts x hidden x intermediate) the matching columns. Every rank routes the same tokens alike (the
    router is whole), computes partial outputs from its slices, and the parts are summed; the gradients
    reaching the hidden states and the routing weights are parts too, summed in backward."""

    @staticmethod
    def check(device_mesh: DeviceMesh, kind: str) -> None:
        """Refuse, on every rank alike, a torch whose DTensor cannot gather a strided shard whole (2.11 trains
        through one but fails to gather it for a checkpoint): a collective of two numbers, before any split."""
        from torch.distributed.tensor.placement_types import _StridedShard

        probe = DTensor.from_local(
            torch.zeros(1, 2, 1, device=device_mesh.device_type), device_mesh, [_StridedShard(1, split_factor=2)]
        )
        try:
            probe.full_tensor()
        except (ValueError, NotImplementedError, RuntimeError):
            raise UsageError(
                f"tp splits {kind}'s experts with their gate and up halves as a strided shard, which torch"
                f" {torch.__version__.split('+')[0]}'s DTensor cannot gather for a checkpoint (torch 2.14 can);"
                " split the experts with ep or fsdp+ep on this torch, or upgrade torch"
            ) from None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor.placement_types import _StridedShard

        group = device_mesh.get_group()
        for name, placement in (("gate_up_proj", _StridedShard(1, split_factor=2)), ("down_proj", Shard(2))):
            param = module._parameters[name]
            assert param is not None and param.dim() == 3, f"{type(module).__name__}.{name} is not 3-D"
            module.register_parameter(
                name,
                nn.Parameter(
                    distribute_tensor(param.data, device_mesh, [placement]), requires_grad=param.requires_grad
                ),
            )

        def around(forward, hidden_states, *args, **kwargs):
            hidden_states = _SumBackward.apply(hidden_states, group)
            args = list(args)
            if len(args) >= 2:
                args[1] = _SumBackward.apply(args[1], group)
            elif "top_k_weights" in kwargs:
                kwargs["top_k_weights"] = _SumBackward.apply(kwargs["top_k_weights"], group)
            with _params_as(module, lambda p: p.to_local() if isinstance(p, DTensor) else p):
                out = forward(hidden_states, *args, **kwargs)
            return _SumForward.apply(out, group)

        return _wrap_forward(module, around)


def _factories(config: Any) -> dict[str, Any]:
    rope = getattr(config, "qk_rope_head_dim", None)
    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "replicated_with_grad_allreduce": SumGradients,
        "all_reduce": SumOutput,
        "moe_tp_experts": ExpertsSplit,
        "moe_identity_expert": DivideInput,
        "replicate": Unchanged,
        **({"mla_kv_a_proj": lambda: LatentKeyValue(rope)} if isinstance(rope, int) else {}),
    }


def library_styles(declared: dict[str, str], config: Any, kind: str) -> dict[str, ParallelStyle]:
    """A transformers plan ({module or parameter name: word}) as torch's styles by module name.

    An experts module's ``gate_up_proj`` and ``down_proj`` entries are taken by its moe_tp_experts entry
    (and must be packed_colwise and rowwise); any other word torchfleet does not map is refused by name."""
    known = _factories(config)
    experts = {key for key, word in declared.items() if word == "moe_tp_experts"}
    plan: dict[str, ParallelStyle] = {}
    for key, word in declared.items():
        owner, _, leaf = key.rpartition(".")
        if owner in experts and leaf in EXPERT_PARAMS:
            if word != EXPERT_PARAMS[leaf]:
                raise UsageError(
                    f"{kind}'s base_model_tp_plan splits {key} {word}; torchfleet splits experts with their"
                    f" gate_up_proj packed_colwise and down_proj rowwise (Megatron's MLP split); use ep or fsdp+ep"
                )
            continue
        if word == "packed_colwise":
            raise UsageError(
                f"{kind}'s base_model_tp_plan splits {key} with 'packed_colwise' outside an experts module, which"
                " torchfleet's tp does not map; use fsdp, or give tp_plan={module: ColwiseParallel(), ...}"
            )
        if word in STYLES_REFUSED or word not in known:
            what = STYLES_REFUSED.get(word, "a style torchfleet does not know")
            raise UsageError(
                f"{kind}'s base_model_tp_plan splits {key} with {word!r} ({what}), which torchfleet's tp does not"
                " map to torch's styles; use fsdp, or give tp_plan={module: ColwiseParallel() or RowwiseParallel()}"
            )
        plan[key] = known[word]()
    for key in experts:
        for leaf, word in EXPERT_PARAMS.items():
            if declared.get(f"{key}.{leaf}") != word:
                raise UsageError(
                    f"{kind}'s base_model_tp_plan splits {key} moe_tp_experts without {key}.{leaf} {word};"
                    " torchfleet splits experts as Megatron splits an MLP only; use ep or fsdp+ep"
                )
    return plan
