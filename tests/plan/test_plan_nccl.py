"""plan's collectives between GPUs as NCCL runs them (plan/nccl.py): ring or tree by size and scale, each with
its own latency over GPUs in nodes; DDP's buckets as torch fills them; and what that does to a plan's scaling.

The figures are worked by hand from NCCL's tuner constants (src/graph/tuning.cc): latencies in microseconds,
base (tree, ring; Simple) 8.4 and 8.4, a step over NVLink 4.0 (tree) and 3.4 (ring), over the network 14;
a tree all-reduce's bandwidth 92% of the bus's, its bytes twice."""

from __future__ import annotations

import pytest

from torchfleet.plan import comm, nccl, predict
from torchfleet.plan.layouts import layout
from torchfleet.plan.profile import Profile

MIB = 2**20
LINK_25G = 25e9 / 8


def test_an_all_reduce_across_64_nodes_goes_by_tree_and_pays_its_depth_not_its_ring():
    """25 MiB (a DDP bucket) over 512 GPUs in 64 nodes at 25 Gbit/s: the tree's latency is 2 x (7 NVLink steps
    in a node + log2(64) network steps); the ring's 1,022 steps would cost 4.8 ms, and the old planner's
    1,022 x 40 us, 41 ms."""
    seconds, algorithm = nccl.collective_s("all_reduce", 25 * MIB, 512, 64, LINK_25G, "nvlink")
    latency = (8.4 + 2 * (7 * 4.0 + 6 * 14.0)) * 1e-6
    assert algorithm == "tree/Simple"
    assert seconds == pytest.approx(latency + 2 * 25 * MIB / (0.92 * LINK_25G), rel=1e-9)
    ring_latency = (8.4 + (1022 - 126) * 3.4 + 126 * 14.0) * 1e-6
    assert ring_latency == pytest.approx(4.8188e-3, rel=1e-4)
    # Twice the nodes add one level of the tree: 2 x 14 us, not 1,024 more ring steps.
    wider, _ = nccl.collective_s("all_reduce", 25 * MIB, 1024, 128, LINK_25G, "nvlink")
    assert wider - seconds == pytest.approx(2 * 14.0e-6, rel=1e-6)


def test_a_large_all_reduce_goes_by_ring_and_its_bytes_dominate():
    """4 GB over 128 GPUs in 16 nodes at 400 Gbit/s: ring/Simple, 2 x 127/128 of the bytes over the bus, and
    2 x 127 steps, 2 x 15 of them between nodes."""
    seconds, algorithm = nccl.collective_s("all_reduce", 4e9, 128, 16, 50e9, "nvlink")
    assert algorithm == "ring/Simple"
    latency = (8.4 + (254 - 30) * 3.4 + 30 * 14.0) * 1e-6
    assert seconds == pytest.approx(2 * 127 / 128 * 4e9 / 50e9 + latency, rel=1e-9)


def test_all_gathers_and_reduce_scatters_go_by_ring():
    seconds, algorithm = nccl.collective_s("reduce_scatter", 4e9, 16, 2, 50e9, "nvlink")
    assert algorithm == "ring/Simple"
    assert seconds == pytest.approx(15 / 16 * 4e9 / 50e9 + (8.4 + 14 * 3.4 + 1 * 14.0) * 1e-6, rel=1e-9)
    assert nccl.collective_s("all_gather", 1e6, 1, 1, 50e9, "nvlink") == (0.0, "-")


def test_a_group_of_one_gpu_a_node_pays_the_trees_network_latency_a_step():
    """HSDP's replicas, one GPU in each of 8 nodes, all-gather 1 kB: ring/LL, its 7 steps each at the tree's
    network latency (5.0 us), not the ring's (2.7), as the tuner charges a group whose steps all cross nodes."""
    seconds, algorithm = nccl.collective_s("all_gather", 1e3, 8, 8, 50e9, "nvlink")
    assert algorithm == "ring/LL"
    assert seconds == pytest.approx((6.6 + 7 * 5.0) * 1e-6 + 7 / 8 * 1e3 / (0.5 * 50e9), rel=1e-9)
    # Two GPUs a node: the steps between nodes pay the ring's own.
    seconds, _ = nccl.collective_s("all_gather", 1e3, 16, 8, 50e9, "nvlink")
    assert seconds == pytest.approx((6.6 + 8 * 1.0 + 7 * 2.7) * 1e-6 + 15 / 16 * 1e3 / (0.5 * 50e9), rel=1e-9)


def test_a_gpu_clusters_links_take_nccls_latencies_over_the_nodes_a_group_spans(h100_nodes):
    target = h100_nodes(64)
    assert target.link_for(8).hw == "nvlink" and target.link_for(8).nodes == 1
    across = target.link_for(512)
    assert (across.nodes, across.bandwidth) == (64, LINK_25G)
    assert comm.all_reduce_s(25 * MIB, 512, across) == pytest.approx(
        nccl.collective_s("all_reduce", 25 * MIB, 512, 64, LINK_25G, "nvlink")[0]
    )


def test_ddp_fills_a_first_bucket_of_1_mib_then_25_mib_each():
    assert comm.buckets(100 * MIB, 25 * MIB, 1 * MIB) == [MIB, 25 * MIB, 25 * MIB, 25 * MIB, 24 * MIB]
    assert comm.buckets(0.5 * MIB, 25 * MIB, 1 * MIB) == [0.5 * MIB]
    link = comm.Link(LINK_25G, hw="nvlink", nodes=64)
    whole, last = comm.bucketed_all_reduce_s(100 * MIB, 512, link, 25 * MIB, MIB)
    assert whole == pytest.approx(sum(comm.all_reduce_s(b, 512, link) for b in comm.buckets(100 * MIB, 25 * MIB, MIB)))
    assert last == pytest.approx(comm.all_reduce_s(24 * MIB, 512, link))


def _profile(parameters: int, flops_per_sample: float) -> Profile:
    return Profile(
        "m", parameters, parameters, parameters // 12, 13, 1e5, 1024, flops_per_sample, "adamw", 1e6, 0.0, 0.0
    )


@pytest.mark.parametrize("gpus", [128, 512])
def test_more_parameters_per_flop_scale_worse_under_ddp_on_a_slow_link(gpus, h100_nodes):
    """Issue 61: across a 25 Gbit/s link a model with three times the parameters per FLOP was predicted to scale
    better at 128 ranks (97% against 95%): at that scale the ring's per-hop latency, the same for both, hid the
    bytes. With NCCL's algorithms the gradients' bytes rule, and the heavier model scales worse."""
    target = h100_nodes(gpus // 8)
    efficiency = {}
    for name, params in (("light", 125_000_000), ("heavy", 375_000_000)):
        profile = _profile(params, 6 * 125_000_000 * 1024)
        batch = 16 * gpus
        alone = predict.step_time(profile, layout("serial", 1, 16, profile), 16, target, 1, None)["step"]
        many = predict.step_time(profile, layout("ddp", gpus, batch, profile), batch, target, 1, None)
        efficiency[name] = alone / many["step"]
        # Every bucket its own NCCL all-reduce over the GPUs' nodes: fp32 gradients, 1 MiB first, 25 MiB each.
        sizes = comm.buckets(4 * params, 25 * MIB, MIB)
        wire = sum(nccl.collective_s("all_reduce", b, gpus, gpus // 8, LINK_25G, "nvlink")[0] for b in sizes)
        assert many["communication_total"] == pytest.approx(wire, rel=1e-9)
    print(gpus, efficiency)
    assert efficiency["heavy"] < efficiency["light"] < 1
