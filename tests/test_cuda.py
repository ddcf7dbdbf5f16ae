"""The GPU suite, run by `make gpu-check` on a machine with a CUDA GPU; skipped elsewhere.

Every path one GPU allows, each against the CPU run of the same job (a fresh
process that sees no GPU, `testing.devices.on_cpu`):
- serial, dp and mp on CUDA;
- ddp and fsdp in one process that a launcher started: a group of one on NCCL;
- ddp on 2 processes sharing the GPU: NCCL refuses two ranks on one device,
  so torchfleet picks Gloo, which all-reduces CUDA tensors; fsdp there is
  refused in one sentence (Gloo has no all-gather or reduce-scatter for them);
- bf16 autocast, fp16 with the GradScaler and a skipped step;
- checkpoint and resume on CUDA; `torchfleet doctor` naming NCCL and why.

Tolerances. fp32 on a GPU runs other kernels than on the CPU (cuBLAS against
MKL, other summation orders), and torch keeps TF32 off for matmuls by
default, so the MLP's weights after 5 SGD steps differ by rounding only: 1e-4
bounds that with room. Convolutions would use TF32 (cuDNN's default), which
is why these jobs use the MLP. bf16 keeps 8 bits of mantissa, so its bound is
2e-2; that it differs from fp32 at all (above 1e-6) shows bf16 really ran.
These bounds were set before any GPU ran this suite; the first run's figures
go in docs/benchmarks/history.md.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

from torchfleet import launch
from torchfleet.launcher import LaunchError
from torchfleet.testing.devices import fleet_facts, fp16_skip_job, on_cpu, trained_facts
from torchfleet.testing.equivalence import resumed_equals_straight, train_k_steps

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: `make gpu-check` runs this suite on a GPU machine"
)

FP32_BOUND, BF16_BOUND = 1e-4, 2e-2


@functools.lru_cache(maxsize=None)
def _cpu_serial() -> torch.Tensor:
    return on_cpu(train_k_steps, "serial")  # one spawned process for the whole suite


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, options", [("serial", {}), ("dp", {}), ("mp", {"devices": "cuda:0,cuda:0"})])
def test_single_process_strategies_on_cuda_match_the_cpu(strategy, options):
    assert fleet_facts(strategy, **options)["device"].startswith("cuda")
    got = train_k_steps(strategy, **options)
    assert _diff(got, _cpu_serial()) < FP32_BOUND


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, wrapper", [("ddp", "DistributedDataParallel"), ("fsdp", "FSDPSequential")])
def test_one_process_of_ddp_or_fsdp_runs_on_nccl_and_matches_the_cpu(strategy, wrapper):
    ((facts, got),) = launch(trained_facts, nprocs=1, args=(strategy,))  # torchrun -n 1: a group of one
    assert (facts["device"], facts["backend"], facts["group"]) == ("cuda:0", "nccl", 1)
    assert (facts["strategy"], facts["wrapper"]) == (strategy, wrapper)
    assert _diff(got, _cpu_serial()) < FP32_BOUND


@pytest.mark.timeout(300)
def test_ddp_on_two_processes_shares_the_gpu_over_gloo():
    if torch.cuda.device_count() > 1:
        pytest.skip("with 2 GPUs each process has its own: NCCL, covered by the multi-process suites")
    facts = launch(fleet_facts, nprocs=2, args=("ddp",))
    assert [f["device"] for f in facts] == ["cuda:0", "cuda:0"]
    assert all(f["backend"] == "gloo" and "a GPU of its own" in f["reason"] for f in facts)
    got = launch(train_k_steps, nprocs=2, args=("ddp",))[0]
    assert _diff(got, _cpu_serial()) < FP32_BOUND


@pytest.mark.timeout(300)
def test_fsdp_on_processes_sharing_the_gpu_is_refused_in_one_sentence():
    if torch.cuda.device_count() > 1:
        pytest.skip("with 2 GPUs each process has its own")
    with pytest.raises(LaunchError, match="fsdp on 2 processes sharing 1 GPU.* Gloo does not run on GPU tensors"):
        launch(fleet_facts, nprocs=2, args=("fsdp",))


@pytest.mark.timeout(300)
def test_bf16_autocast_on_cuda_stays_near_fp32():
    got = train_k_steps("serial", precision="bf16")
    diff = _diff(got, _cpu_serial())
    assert 1e-6 < diff < BF16_BOUND, f"bf16 against fp32 on the CPU: {diff:.3g}"


@pytest.mark.timeout(300)
def test_fp16_with_the_grad_scaler_skips_an_overflowing_step():
    result = fp16_skip_job(steps=5, poisoned=3)
    assert result["device"].startswith("cuda")
    assert result["scales"] == [65536.0] * 2 + [32768.0] * 3  # halved once, at the skipped step
    weights = result["weights"]
    for step in range(1, 6):
        moved = _diff(weights[step], weights[step - 1])
        assert (moved == 0) if step == 3 else (moved > 1e-4), f"step {step}: weights moved {moved:.3g}"


@pytest.mark.timeout(300)
def test_checkpoint_and_resume_on_cuda_equal_the_straight_run(tmp_path):
    straight, resumed = resumed_equals_straight("serial", str(tmp_path / "ckpt"))
    assert _diff(straight, resumed) == 0  # model, optimizer and the CUDA generator all restored


@pytest.mark.timeout(120)
def test_doctor_names_nccl_and_why():
    out = subprocess.run([sys.executable, "-m", "torchfleet", "doctor"], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "nccl" in out.stdout.lower() and "CUDA GPU" in out.stdout and "fastest" in out.stdout


@pytest.mark.timeout(300)
def test_per_rank_figures_on_cuda_name_a_slow_rank_and_read_the_gpu_memory(tmp_path):
    """Issue 40 on a GPU: 2 processes sharing it, rank 1 slowed 30 ms a step in its loader. On CUDA the
    host runs ahead, but data_s is still exact, so the verdict names rank 1 / data; memory is the
    allocator's peak on the GPU, not the host's resident set."""
    from helpers import clean_env, torchfleet

    out = tmp_path / "metrics.jsonl"
    job = ["train", "--strategy", "ddp", "-n", "2", "--model", "mlp", "--data", "synthetic"]
    job += ["--synthetic-size", "2048", "--batch-size", "64", "--max-steps", "20", "--log-every", "2"]
    job += ["--no-progress", "--hang-timeout", "0", "--metrics-out", str(out)]
    env = clean_env(TORCHFLEET_FAULT="slow:rank=1:step=3:phase=data:seconds=0.03")
    done = torchfleet(*job, env=env, timeout=250)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    verdicts = [(r["rank"], r["phase"]) for r in rows if r["kind"] == "straggler"]
    assert verdicts == [(1, "data")], verdicts
    ranks = [r for r in rows if r["kind"] == "rank"]
    assert len(ranks) == 2 * 10
    for r in ranks:
        assert r["memory_kind"] == "cuda_max_allocated"
        assert 0 < r["memory_bytes"] < 1 << 30  # the mlp's weights, gradients and a batch: far below a GiB
    last = {r["rank"]: r for r in ranks if r["step"] == 20}
    assert last[1]["data_s"] >= 0.03 and last[0]["data_s"] < 0.02
