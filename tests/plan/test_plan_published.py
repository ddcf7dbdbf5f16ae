"""plan --hf-config held against published runs: torchtitan's measured Llama 3.1 tables, within issue 37's bounds.

torchtitan's December 2024 Llama 3 H100 benchmark (Tables 1 and 3, in its repository's benchmarks folder) and
its performance notes (the 405B row) ran on 96 GB HBM2e SXM H100s held to 500 W,
the table's H100-HBM2E. The published figures: Llama 3.1 8B, FSDP, local batch 2, sequence 8192,
selective checkpointing, eager, 5,762 tokens/s a GPU and 82.4 GiB reserved on 8 GPUs, 5,605 and 67.0 on
128; 405B on 128 (FSDP 16 x TP 8, full checkpointing) 109 tokens/s a GPU. The plan is the published
inputs with the table's figures, no factor of its own: a change to the trace, the sharding, the cost of
a collective or the efficiency that moves a row past its bound fails here.
"""

from __future__ import annotations

import json

import pytest

from helpers import forked_torchfleet, require_module

require_module("transformers", "transformers (the test extra) builds the library models from configs")

CLUSTER = ["--gpu", "H100-HBM2E", "--gpus-per-node", "8", "--nodes", "16", "--link", "400", "--tp"]


def _plan(tmp_path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    result = forked_torchfleet("plan", *args, "--json-out", str(out), timeout=240)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_8b_on_8_and_128_gpus_holds_torchtitans_tables(tmp_path):
    doc = _plan(tmp_path, "--hf-config", "llama-3.1-8b", *CLUSTER, "1", "--nproc", "8,128")
    rows = {r["gpus"]: r for r in doc["rows"] if r["dp_replicate"] == 1}
    published = {8: (5762, 82.4), 128: (5605, 67.0)}
    for gpus, (tokens, reserved_gib) in published.items():
        row = rows[gpus]
        print(f"{gpus} GPUs: {row['tokens_per_s_per_gpu']:.0f} tokens/s, {row['reserved'] / 2**30:.1f} GiB reserved")
        assert row["layout"] == f"FSDP {gpus}"
        assert abs(row["reserved"] / 2**30 / reserved_gib - 1) <= 0.10  # issue 37: memory within 10%
        assert abs(row["tokens_per_s_per_gpu"] / tokens - 1) <= 0.20  # tokens/s within 20%
    # The change from 8 to 128 GPUs, published -2.7% in tokens/s and -18.7% in memory: memory within 5 points,
    # tokens/s within 8. The plan's -9.6% is most of it the compute that FSDP's collectives hide behind, slowed
    # 18.9% for each second hidden (plan/overlap.py): 1.3 s of them cross the network at 128 GPUs, 0.1 s NVLink at
    # 8. That figure was measured inside a node (Lee et al., 4 GPUs); this pair says that across the network it
    # costs less, where the table's other runs across nodes read closer to their figures with it.
    for key, index, points in (("tokens_per_s_per_gpu", 0, 0.08), ("reserved", 1, 0.05)):
        predicted = rows[128][key] / rows[8][key] - 1
        measured = published[128][index] / published[8][index] - 1
        assert abs(predicted - measured) <= points, (key, predicted, measured)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_405b_on_128_gpus_holds_torchtitans_row(tmp_path):
    doc = _plan(tmp_path, "--hf-config", "llama-3.1-405b", *CLUSTER, "8", "--nproc", "128", "--ac", "full")
    (row,) = [r for r in doc["rows"] if r["gpus"] == 128 and r["dp_replicate"] == 1]
    print(f"405B: {row['layout']}, {row['tokens_per_s_per_gpu']:.1f} tokens/s, {row['reserved'] / 2**30:.1f} GiB")
    assert row["layout"] == "FSDP 16 x TP 8" and row["fits"]  # it ran on 95 GB cards; memory was not published
    # Priced by operator (plan/kernels.py) this row reads 1.32: a 405B step is mostly large products at the
    # H100's MAMF, while the published run reached 29% of the SXM peak (docs/benchmarks/validation.md).
    assert abs(row["tokens_per_s_per_gpu"] / 109 - 1) <= 0.35


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_405b_pipelines_hold_torchtitans_table_5_memory_per_schedule(tmp_path):
    """Table 5 of the December 2024 benchmark: 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 and global
    batch 256, full checkpointing; torchtitan then split a step into pp (8) micro-batches, 4 samples each, and
    interleaved 1F1B ran 2 stages a GPU. Published: 1F1B 82.5 GiB, interleaved 72.7 (footnote: the fullest
    GPU's). Both hold 8 micro-batches of a stage's blocks on the first GPU (interleaved runs its 16 half-stage
    forwards before a backward); interleaved's backwards start on its later stage, whose gradients are
    reduce-scattered before the earlier stage's are made, so half the stage's unsharded gradients at once.
    Float8, compile and async TP, which the table also ran, are not planned."""
    doc = _plan(
        tmp_path,
        "--hf-config",
        "llama-3.1-405b",
        *CLUSTER[:5],
        "64",
        *CLUSTER[6:],
        "8",
        "--pp",
        "8",
        "--nproc",
        "512",
        "--ac",
        "full",
        "--local-batch",
        "32",
        "--global-batch",
        "256",
        "--microbatches",
        "8",
    )
    rows = {r["schedule"]: r for r in doc["rows"] if r.get("pp") == 8}
    plain, looped = rows["1f1b"], rows["interleaved-1f1b"]
    for row in (plain, looped):
        gib = {k: round(v / 2**30, 1) for k, v in row["memory"].items()}
        print(
            f"{row['layout']}: {row['reserved'] / 2**30:.1f} GiB reserved, {gib}, {row['tokens_per_s_per_gpu']:.0f} t/s"
        )
        assert row["layout"].startswith("FSDP 8 x TP 8 x PP 8") and row["microbatches"] == 8
        assert row["batch"] == "4 x 8 x 8"
    for row, published in ((plain, 82.5), (looped, 72.7)):
        assert abs(row["reserved"] / 2**30 / published - 1) <= 0.15
    assert looped["reserved"] < plain["reserved"]  # published 9.8 GiB less
    # The same activations (8 micro-batches of the stage on the first GPU), half the gradients.
    assert looped["memory"]["activations"] == pytest.approx(plain["memory"]["activations"])
    assert looped["memory"]["gradients"] == pytest.approx(plain["memory"]["gradients"] / 2, rel=0.01)
