"""Fixtures the planner's tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An XDG_CACHE_HOME for one test file's `plan` runs: the machine probe runs once a file, not once a test."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def h100_nodes():
    """Nodes of 8 H100s in bf16 joined by `inter_gbit` (25 Gbit/s unless given), as `plan` describes a cluster."""
    from torchfleet.plan.hardware import gpu_cluster

    def cluster(nodes: int, inter_gbit: float = 25):
        return gpu_cluster(
            nodes=nodes,
            per_node=8,
            gpu="H100",
            tflops=None,
            memory_gb=None,
            mfu=None,
            precision="bf16",
            intra_gbit=None,
            inter_gbit=inter_gbit,
        )

    return cluster
