"""What the plan is for: this machine, or a described cluster of nodes x devices joined by links.

A GPU is known by name from the table below (dense peaks and memory, from
NVIDIA's datasheets) or described with --tflops and --memory-gb. The achieved
fraction of a GPU's peak (model FLOPs utilisation) is not on any datasheet:
--mfu gives it, default DEFAULT_MFU for the precision planned, measured.

fp32 is planned against the card's plain FP32 peak, not TF32's: torch keeps
TF32 off for matrix products by default (`torch.backends.cuda.matmul
.allow_tf32`), and fp32 steps run cuBLAS's FFMA kernels, near the FP32 peak and
far below TF32's. The defaults are measured eager steps of the built-in models
on one GPU, rounded down (docs/benchmarks/history.md, "GPU" and "The eighth
run"): a larger model, or one compiled, reaches more, and --mfu says so. One
efficiency cannot fit a transformer and a ResNet at once; the bf16 default sits
between the two, so that neither is planned far off.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from torchfleet.errors import UsageError
from torchfleet.plan import kernels
from torchfleet.plan.comm import Link

DEFAULT_MFU = {"fp32": 0.65, "bf16": 0.18, "fp16": 0.18}

# name: (dense bf16 TFLOP/s, dense TF32 TFLOP/s (fp32 where the card has no TF32), plain FP32 TFLOP/s, memory GB).
# Sources: NVIDIA datasheets: H100 SXM5 and H100 PCIe (2023), H200 SXM (2024), A100 SXM 80GB (2021;
# the 40GB card has the same peaks), V100 SXM2 (no bf16: fp16 figure), L4 (2023), A10G (AWS's A10
# variant, NVIDIA A10 datasheet figures), T4 (no bf16: fp16 figure), L40S (2023). Dense: without the
# 2:4 structured sparsity that doubles the headline figures. H100-HBM2E is the 96 GB HBM2e SXM H100 held to
# 500 W that torchtitan's December 2024 benchmark ran on: its footnote puts the peak "between SXM and NVL" without
# a figure, so each figure here is the middle of the H100 SXM's and the H100 NVL's datasheet peaks. On an SXM H100
# at 700 W a Llama 3.1 8B step draws 685 W and runs its SM clock at 1,597 MHz, held back by the power cap
# (benchmarks/power_probe.py, docs/benchmarks): a card held to 500 W cannot keep that clock.
GPUS: dict[str, tuple[float, float, float, float]] = {
    "H200": (989.4, 494.7, 67.0, 141.0),
    "H100": (989.4, 494.7, 67.0, 80.0),
    "H100-HBM2E": (912.2, 456.1, 63.5, 96.0),
    "H100-PCIE": (756.0, 378.0, 51.0, 80.0),
    "H100-NVL": (835.0, 417.5, 60.0, 94.0),
    "MI300X": (1307.4, 653.7, 163.4, 192.0),
    "A100": (312.0, 156.0, 19.5, 80.0),
    "A100-40GB": (312.0, 156.0, 19.5, 40.0),
    "L40S": (362.1, 183.0, 91.6, 48.0),
    "A10G": (125.0, 62.5, 31.2, 24.0),
    "L4": (121.0, 60.0, 30.3, 24.0),
    "V100": (125.0, 15.7, 15.7, 32.0),
    "T4": (65.0, 8.1, 8.1, 16.0),
}

# Links between machines and inside one, when --link does not say: NVLink 4 (H100 SXM: 450 GB/s each
# way), PCIe 4 x16 (about 25 GB/s usable), 100 Gbit/s Ethernet or InfiniBand HDR100 (12.5 GB/s).
NVLINK_BYTES_S = 450e9
PCIE_BYTES_S = 25e9
DEFAULT_INTER_BYTES_S = 12.5e9
# One point-to-point message between GPUs (a pipeline's send, an all-to-all's part); the collectives take
# NCCL's own latencies instead (plan/nccl.py).
GPU_LATENCY_S = 20e-6


@dataclass(frozen=True)
class Target:
    """The devices a plan is for. `rate` is one device's FLOP/s for the model (achieved, not peak), or
    None on this machine, where the model's own measured step time gives the compute instead."""

    name: str
    nodes: int
    per_node: int  # processes (devices) per node
    memory_bytes: float  # per device; on CPU hosts per node, which its processes share
    intra: Link  # between processes on one node
    inter: Link  # between nodes
    rate: float | None = None
    cores_per_node: int = 0  # CPU hosts: cores the processes of one node share; 0 for GPUs
    here: bool = False  # this machine, calibrated by its own probes
    # How a traced step's compute is priced (plan/kernels.py); None: its FLOPs at `rate`.
    compute: kernels.Compute | None = None

    def compute_s(self, flops: float, work: tuple[tuple[str, float], ...] = ()) -> float:
        """One rank's seconds for a traced step's `flops`, split by what bounds them as `work` says."""
        if self.compute is not None:
            return kernels.seconds(self.compute, flops, work)
        assert self.rate is not None
        return flops / self.rate

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    def link_for(self, ranks_together: int) -> Link:
        """The link a collective over `ranks_together` consecutive ranks crosses: the slower one if it leaves a node;
        between GPUs, with the nodes it spans, for NCCL's latencies (a group strided over them spans them all)."""
        link = self.inter if ranks_together > self.per_node else self.intra
        if not link.hw:
            return link
        return replace(link, nodes=max(1, -(-ranks_together // self.per_node)))

    def as_dict(self) -> dict:
        out = asdict(self)
        out["intra"], out["inter"] = self.intra.as_dict(), self.inter.as_dict()
        return out


def gpu_figures(name: str, precision: str) -> tuple[float, float]:
    """(peak FLOP/s, memory bytes) of a GPU in the table; UsageError naming the choices otherwise."""
    key = name.upper().replace(" ", "-")
    if key not in GPUS:
        raise UsageError(
            f"GPU {name!r} is not in torchfleet's table ({', '.join(GPUS)}); give its figures"
            " with --tflops (dense, at the precision planned) and --memory-gb"
        )
    bf16, _tf32, fp32, memory_gb = GPUS[key]
    return (fp32 if precision == "fp32" else bf16) * 1e12, memory_gb * 1e9


def gpu_cluster(
    *,
    nodes: int,
    per_node: int,
    gpu: str | None,
    tflops: float | None,
    memory_gb: float | None,
    mfu: float | None,
    precision: str,
    intra_gbit: float | None,
    inter_gbit: float | None,
    by_operator: bool = False,
    compile: bool = False,
    float8: bool = False,
    attention: str = "fused",
) -> Target:
    """A described GPU cluster; figures given as flags win over the table's (`mfu` None: DEFAULT_MFU's). A
    GPU of plan/kernels.py's table planned in bf16 `by_operator` (a traced step's, without --mfu or --tflops)
    has its compute priced by operator there (with `compile`, `float8` and `attention`); any other at `mfu` of its peak."""
    fixed = not by_operator or tflops is not None
    _check_counts(nodes, per_node, "--gpus-per-node")
    mfu = DEFAULT_MFU[precision] if mfu is None else mfu
    if not 0 < mfu <= 1:
        raise UsageError(f"--mfu {mfu} must be a fraction of the peak, above 0 and at most 1")
    peak = memory = None
    if gpu is not None and (tflops is None or memory_gb is None):
        peak, memory = gpu_figures(gpu, precision)
    if tflops is not None:
        peak = _positive("--tflops", tflops) * 1e12
    if memory_gb is not None:
        memory = _positive("--memory-gb", memory_gb) * 1e9
    if peak is None or memory is None:
        raise UsageError(
            "a GPU cluster needs --gpu NAME (one of " + ", ".join(GPUS) + ") or both --tflops and --memory-gb"
        )
    sxm = (gpu or "").upper().replace(" ", "-") in ("H100", "H100-HBM2E", "H200", "A100")
    intra = intra_gbit * 1e9 / 8 if intra_gbit else (NVLINK_BYTES_S if sxm else PCIE_BYTES_S)
    inter = inter_gbit * 1e9 / 8 if inter_gbit else DEFAULT_INTER_BYTES_S
    name = f"{nodes} x {per_node} {gpu or 'GPU'}" + ("" if tflops is None else f" ({tflops:g} TFLOP/s)")
    # The link inside a node, whose latencies NCCL's collectives pay for their steps there (plan/nccl.py).
    hw = "nvlink" if sxm else "pci"
    return Target(
        name,
        nodes,
        per_node,
        memory,
        Link(intra, GPU_LATENCY_S, hw),
        Link(min(inter, intra), 2 * GPU_LATENCY_S, hw),
        rate=peak * mfu,
        compute=kernels.for_gpu(
            gpu, precision, compile=compile, float8=float8, rate=peak * mfu, fixed=fixed, attention=attention
        ),
    )


def _check_counts(nodes: int, per_node: int, flag: str) -> None:
    if nodes < 1:
        raise UsageError(f"--nodes {nodes} must be at least 1: a plan needs a machine to run on")
    if per_node < 1:
        raise UsageError(f"{flag} {per_node} must be at least 1")


def _positive(flag: str, value: float) -> float:
    if not value > 0:
        raise UsageError(f"{flag} {value:g} must be above 0")
    return value


def cpu_cluster(
    *, nodes: int, cores_per_node: int, memory_gb: float, intra: Link, inter_gbit: float | None, name: str = ""
) -> Target:
    """CPU hosts, `cores_per_node` each: a process per core, at the rates measured here."""
    _check_counts(nodes, cores_per_node, "--cpus-per-node")
    inter = Link(inter_gbit * 1e9 / 8, 50e-6) if inter_gbit else Link(DEFAULT_INTER_BYTES_S / 10, 50e-6)
    return Target(
        name or f"{nodes} x {cores_per_node}-core CPU hosts",
        nodes,
        cores_per_node,
        _positive("--memory-gb", memory_gb) * 1e9,
        intra,
        inter,
        cores_per_node=cores_per_node,
    )
