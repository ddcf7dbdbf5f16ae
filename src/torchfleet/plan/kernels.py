"""A step's compute priced by what bounds each operator, per GPU kind, instead of one fraction of the peak.

The trace (plan/step_counter.py) splits one rank's step three ways: the FLOPs of matrix products
(mm, addmm, bmm, grouped and scaled products, convolutions), the FLOPs of fused attention, and the bytes
that every other operator reads and writes. Each part runs at the rate that bounds it on the GPU planned:

- matrix products at the kind's measured best matmul rate (MAMF: the fastest of a sweep of shapes, as a
  fraction of the dense peak), so a GPU whose products reach less of its peak is planned slower;
- attention at a flash kernel's fraction of the peak, on half the FLOPs torch counts, as a causal kernel
  skips the masked half;
- the rest at the HBM bandwidth times MEMORY_FRACTION.

What the two options change:

- `compile` (torch.compile): Inductor fuses chains of pointwise operators, so each reads its inputs from the
  kernel before it without a trip to memory and only writes its output; reductions, norms, copies, embeddings
  and the optimizer's operators move what they did.
- `float8` (torchao's float8 linear layers, tensorwise scaling): matrix products run on the FP8 tensor cores at
  the kind's FP8 MAMF, and each product's operands are first read in bf16 and written in float8 (1.5 times
  their bf16 bytes, memory-bound). A kind without FP8 tensor cores cannot plan it.

Sources of the figures (dense, without 2:4 sparsity): peaks and bandwidths from the vendors' datasheets
(NVIDIA H100 SXM5/PCIe/NVL 2023, H200 2024, A100 80GB/40GB 2021, L40S 2023; AMD Instinct MI300X 2023);
H100-HBM2E is the 96 GB HBM2e H100 at 500 W of torchtitan's December 2024 benchmark, 2.4 TB/s as its page
gives it (peaks: plan/hardware.py). Matmul fractions: Stas Bekman's "Machine Learning Engineering",
compute/accelerator, "Maximum Achievable Matmul FLOPS comparison table" (bf16: A100 SXM 271.2 of 312, A100
PCIe 252.9 of 312, H100 SXM 794.5 of 989 and the same on H200, MI300X 668.4 of 1300; fp8: H100 SXM 1402.6
and H200 1453.4 of 1979). Kinds with no row there take the measured row of their nearest kind, named below.
Attention: FlashAttention-2 (Dao, 2023, arXiv 2307.08691), torch's flash backend: 50-73% of the A100's peak
forward and backward (0.6 here, inside that range) and up to 335 TFLOP/s on an H100 SXM (0.34), which the
Hopper kinds take. cuDNN's fused attention (`--attention cudnn`: Transformer Engine's DotProductAttention,
SDPA's cuDNN backend), Hopper kinds only: FlashAttention-3's paper (Shah et al., 2024, arXiv 2407.08608,
Figures 5 and 6) measured it on an H100 SXM at head dim 128 and sequence 4k: 518 TFLOP/s forward (causal)
and 499 backward; with backward 2.5 times forward's FLOPs that is 504 TFLOP/s, 0.51 of the peak. The same
figures put FlashAttention-2 at 319 and 310, 0.32 together, beside the 0.34 above.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchfleet.errors import UsageError

# How attention runs: a fused kernel that holds no score matrix (FlashAttention-2, memory-efficient SDPA), cuDNN's
# fused kernel (held alike, faster on Hopper), or eager's math (the scores materialised, masked, softmaxed and
# dropped out by operators of their own).
ATTENTION = ("fused", "cudnn", "eager")

# How fsdp+ep's tokens reach their experts (plan/experts_at_scale.py): all-to-alls of a row per chosen expert
# (torchtitan's), or DeepEP's dispatch and combine, a row per token and rank that holds any of its experts.
DISPATCH = ("all-to-all", "deepep")

# What `compile` may name, as torchtitan's compile.components does: each block ("model") and the loss.
COMPILE_COMPONENTS = ("model", "loss")

# Achievable share of HBM bandwidth for streaming kernels; not from a kind's own measurement. The simplest streaming
# kernel, a device-to-device copy, reached 0.867 on an H100 SXM (2,903 of 3,350 GB/s: Voltage Park's and Georgia
# Tech's benchmark, github.com/aigatech/vpbenchmarking); eager's operators (broadcasts, reductions, casts) reach
# less, so this sits below it. Not fitted to the validation table: its rows that read fast would read closer lower.
MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class Kernels:
    """One GPU kind's rates: dense peaks (FLOP/s), HBM bytes/s, and the achieved fractions."""

    bf16: float
    fp8: float  # 0: no FP8 tensor cores
    bandwidth: float
    matmul: float  # of the bf16 peak, large products (MAMF)
    matmul_fp8: float  # of the fp8 peak
    attention: float  # of the bf16 peak, a causal flash kernel forward and backward
    attention_cudnn: float = 0.0  # of the bf16 peak, cuDNN's fused attention; 0: not measured on this kind


_CUDNN = 3.5 / (1 / 518 + 2.5 / 499) / 989.4  # cuDNN's attention on an H100 SXM (the docstring): 0.51
_H100 = dict(matmul=794.5 / 989.4, matmul_fp8=1402.6 / 1978.9, attention=0.34, attention_cudnn=_CUDNN)
KINDS: dict[str, Kernels] = {
    "H100": Kernels(989.4e12, 1978.9e12, 3.35e12, **_H100),
    "H200": Kernels(989.4e12, 1978.9e12, 4.8e12, **{**_H100, "matmul_fp8": 1453.4 / 1978.9}),
    "H100-HBM2E": Kernels(912.2e12, 1824.4e12, 2.4e12, **_H100),  # H100 SXM's fractions
    "H100-PCIE": Kernels(756.0e12, 1513.0e12, 2.0e12, **_H100),  # H100 SXM's fractions
    "H100-NVL": Kernels(835.0e12, 1670.0e12, 3.9e12, **_H100),  # H100 SXM's fractions
    "A100": Kernels(312e12, 0.0, 2.039e12, matmul=271.2 / 312, matmul_fp8=0.0, attention=0.6),
    "A100-40GB": Kernels(312e12, 0.0, 1.555e12, matmul=271.2 / 312, matmul_fp8=0.0, attention=0.6),
    # A100 PCIe's row (the nearest measured card off NVLink), FA2's A100 fraction.
    "L40S": Kernels(362.1e12, 733.0e12, 0.864e12, matmul=252.9 / 312, matmul_fp8=1402.6 / 1978.9, attention=0.6),
    "MI300X": Kernels(1307.4e12, 2614.9e12, 5.3e12, matmul=668.4 / 1307.4, matmul_fp8=0.0, attention=0.34),
}


@dataclass(frozen=True)
class Compute:
    """How a plan prices compute: a GPU kind's kernels and the options, or (kernels None) one achieved rate."""

    kernels: Kernels | None
    rate: float  # FLOP/s for every FLOP where kernels is None
    compile: bool = False
    float8: bool = False
    attention: str = "fused"  # ATTENTION


def for_gpu(
    gpu: str | None, precision: str, *, compile: bool, float8: bool, rate: float, fixed: bool, attention: str = "fused"
) -> Compute:
    """The kind's kernels for a bf16 plan of a known GPU, unless a fixed rate (--mfu, --tflops) is given."""
    key = (gpu or "").upper().replace(" ", "-")
    kernels = None if fixed or precision != "bf16" else KINDS.get(key)
    if float8 and (kernels is None or not kernels.matmul_fp8):
        fp8 = ", ".join(k for k, v in KINDS.items() if v.matmul_fp8)
        raise UsageError(
            f"--float8 needs a bf16 plan of a GPU with measured FP8 products ({fp8}), without --mfu or --tflops"
        )
    if compile and kernels is None:
        raise UsageError(
            f"--compile prices operators, which needs a bf16 plan of a GPU in the table ({', '.join(KINDS)}),"
            " without --mfu or --tflops"
        )
    if attention == "cudnn" and (kernels is None or not kernels.attention_cudnn):
        hopper = ", ".join(k for k, v in KINDS.items() if v.attention_cudnn)
        raise UsageError(
            f"--attention cudnn is priced from measurements on Hopper GPUs ({hopper}), planned in bf16 without"
            " --mfu or --tflops; use --attention fused elsewhere"
        )
    return Compute(kernels, rate, compile, float8, attention)


def seconds(compute: Compute, flops: float, work: tuple[tuple[str, float], ...]) -> float:
    """One rank's compute seconds for a traced step of `flops` split as `work` (Traced.work); at the fixed rate
    for a step traced without the split."""
    parts = dict(work)
    k = compute.kernels
    if k is None or not parts:
        return flops / compute.rate
    if compute.float8:
        matmul = parts.get("matmul", 0.0) / (k.fp8 * k.matmul_fp8)
        cast = 1.5 * parts.get("operands", 0.0)
    else:
        matmul, cast = parts.get("matmul", 0.0) / (k.bf16 * k.matmul), 0.0
    fraction = k.attention_cudnn if compute.attention == "cudnn" else k.attention
    attention = parts.get("attention", 0.0) / 2 / (k.bf16 * fraction)
    pointwise = parts.get("pointwise_out" if compute.compile else "pointwise", 0.0)
    moved = parts.get("memory", 0.0) + parts.get("gathering", 0.0) + pointwise + cast
    return matmul + attention + moved / (k.bandwidth * MEMORY_FRACTION)
