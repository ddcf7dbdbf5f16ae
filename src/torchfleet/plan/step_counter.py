"""A traced step's FLOPs and tensor-parallel collectives, counted as its operators dispatch (beside
plan/trace.py's memory tracker)."""

from __future__ import annotations


def step_counter():
    """A dispatch mode summing torch's FLOP formulas (torch.utils.flop_counter's table) over every operator it
    sees, with the CPU's fused attention added, which that table leaves out: the same products as the GPU's
    kernels (full, not causal-halved, as torch counts those). Unlike FlopCounterMode it tracks no modules, so
    the memory tracker beside it sees the step exactly as it would alone; `.total` after the step. It also
    adds up DTensor's collectives (tensor parallelism's) by kind in `.collectives`: FSDP2's own go through
    c10d, not these functional collectives, and plan/at_scale.py costs them from the parameters."""
    import torch
    from torch._guards import active_fake_mode
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

    aten = torch.ops.aten
    table = dict(flop_registry)

    def heads_of(q, kv):
        # Grouped key/value heads (enable_gqa) count as the query's heads, as the kernels broadcast them;
        # torch before 2.14 counts only equal head counts.
        return (kv[0], q[1], *kv[2:])

    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        table[aten._scaled_dot_product_flash_attention_for_cpu] = shape_wrapper(
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, heads_of(q, k), heads_of(q, v))
        )
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        table[aten._scaled_dot_product_flash_attention_for_cpu_backward] = shape_wrapper(
            lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(
                grad, q, heads_of(q, k), heads_of(q, v)
            )
        )
    from torchfleet.plan import flash_attention  # noqa: F401 (registers torchfleet's attention operators)

    fused = torch.ops.torchfleet
    table[fused.attention] = shape_wrapper(
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, heads_of(q, k), heads_of(q, v))
    )
    table[fused.attention_backward] = shape_wrapper(
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(
            grad, q, heads_of(q, k), heads_of(q, v)
        )
    )
    if hasattr(aten, "_grouped_mm") and aten._grouped_mm not in table:
        table[aten._grouped_mm] = shape_wrapper(grouped_mm_flops)

    functional = torch.ops._c10d_functional
    gathered = {functional.all_gather_into_tensor.default: "all_gather"}  # the output is group_size inputs
    whole = {functional.reduce_scatter_tensor.default: "reduce_scatter", functional.all_reduce.default: "all_reduce"}

    matmuls = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten.convolution_backward}
    matmuls |= {getattr(aten, name) for name in ("_grouped_mm", "_scaled_mm") if hasattr(aten, name)}
    attention = {op for op in table if "attention" in str(op)} | {fused.attention, fused.attention_backward}
    # Operators that move no data: allocations, and a view that its schema does not mark as one.
    still = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.empty_like, aten._unsafe_view}

    def nbytes(tree) -> int:
        return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))

    class StepCounter(TorchDispatchMode):
        total = 0
        fake_mode = None  # the one the step runs under, set on entry

        def __enter__(self):
            self.fake_mode = active_fake_mode()
            # FLOPs by what bounds their kernels ("matmul", "attention"), and "memory": the bytes that the
            # operators without a FLOP formula read and write (views and bare allocations move none).
            # "pointwise" holds the bytes of those a compiler fuses ("pointwise_out": what they write), "operands"
            # the products' inputs, "gathering" FSDP2's copies of what it gathers and reduces.
            kinds = ("matmul", "attention", "operands", "memory", "gathering", "pointwise", "pointwise_out")
            self.work: dict[str, float] = dict.fromkeys(kinds, 0.0)
            self.collectives: dict[str, float] = {}  # bytes by kind
            self.calls: dict[str, int] = {}
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                # A tensor-parallel operator at the DTensor level has the whole tensors' shapes: declining it
                # here lets DTensor run it on each rank's shards, whose operators come back to be counted.
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            formula = table.get(func._overloadpacket)
            # DTensor works out an output's shape by running the operator on whole-shaped fake tensors under
            # a fake mode of its own: that is not work a rank does.
            if active_fake_mode() is not self.fake_mode:
                return out
            if formula is not None:
                flops = formula(*args, **(kwargs or {}), out_val=out)
                self.total += flops
                packet = func._overloadpacket
                if packet in attention:
                    self.work["attention"] += flops
                elif packet in matmuls:
                    self.work["matmul"] += flops
                    self.work["operands"] += nbytes((args, kwargs))
                else:
                    self.moved(func, args, kwargs, out)
            elif func in gathered or func in whole:
                kind = gathered.get(func) or whole[func]
                tensor = out if func in gathered else args[0]
                self.collectives[kind] = self.collectives.get(kind, 0.0) + tensor.numel() * tensor.element_size()
                self.calls[kind] = self.calls.get(kind, 0) + 1
            elif func.namespace == "torchfleet":
                # A compiled chain's one kernel (plan/compiled.py): it reads its inputs and writes its outputs.
                # (plan prices a compiled step from its eager trace; this counts a fused one traced alone.)
                self.work["memory"] += nbytes((args, kwargs, out))
            elif func.namespace in ("aten", "fsdp") and not func.is_view and func._overloadpacket not in still:
                # Collectives (c10d) move bytes between GPUs, priced apart; prim's operators read metadata.
                self.moved(func, args, kwargs, out)
            return out

        def moved(self, func, args, kwargs, out) -> None:
            if func.namespace == "fsdp":
                # FSDP2's copies into and out of its gather and reduce-scatter buffers: they move what a
                # block gathers, which expert parallelism cuts (plan/experts_at_scale.py).
                self.work["gathering"] += nbytes((args, kwargs, out))
            elif torch.Tag.pointwise in func.tags:
                self.work["pointwise_out"] += nbytes(out)
                self.work["pointwise"] += nbytes((args, kwargs, out))
            else:
                self.work["memory"] += nbytes((args, kwargs, out))

    return StepCounter()


def grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one grouped matrix product (a mixture of experts' experts, as transformers runs them), which
    torch's table leaves out. Tokens (a's rows) are split among the groups, each group's products over its
    own tokens: 2 x tokens x in x out in all, whatever the split. Backward's weight gradient contracts over
    the tokens instead (two 2-D operands, one 3-D output)."""
    import math

    if len(a) == 2 and len(b) == 2:  # [in, tokens] x [tokens, out] -> [groups, in, out]
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape or ()) * a[-1]
