"""A collective's seconds as NCCL runs it between GPUs: ring or tree, by message size and scale, with each
algorithm's latency over a two-level topology (GPUs in nodes, nodes on a network).

NCCL picks, for each call, the algorithm and protocol its tuner predicts fastest, from a latency and a bus
bandwidth per (algorithm, protocol); this is that model (NVIDIA/nccl, src/graph/tuning.cc, its default
tuner constants), for the algorithms every cluster has:

- ring: all-reduce in 2(n-1) steps, all-gather and reduce-scatter in n-1, each step paying its link's
  latency: a step inside a node NVLink's or PCIe's, a step between nodes (2(k-1) of an all-reduce's, k-1
  of the others', k nodes) the network's; (n-1)/n of the bytes (twice for all-reduce) over the bus
  bandwidth;
- tree (all-reduce only): a chain inside each node and a double binary tree across nodes: latency
  2((n/k - 1) intra + log2(k) network), the bytes twice over 92% of the bus bandwidth;
- protocols: LL (lowest latency, half the bandwidth), LL128 (92% of it) and Simple (all of it, the
  largest latency);
- a group of one GPU a node pays a tree's network latency for each of its ring's steps, as the tuner charges.

At 512 GPUs in 64 nodes a 25 MB all-reduce's latency is a tree's 0.23 ms, not a ring of 1,022 hops;
large messages still go by ring, whose bandwidth term is lower. The bus bandwidth is the slowest link the
group crosses (the network's per GPU once it spans nodes): the tuner's too beyond two nodes, its channels
times their network bandwidth (at two nodes or fewer it takes the bandwidth inside a node, which the plan
does not, as each ring's bytes cross the network all the same). NVLink SHARP and CollNet, which need
particular switches, are not planned.
"""

from __future__ import annotations

PROTOCOLS = ("LL", "LL128", "Simple")
# microseconds, (LL, LL128, Simple): tuning.cc's baseLatencies and hwLatencies.
BASE_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
HW_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
}
NET_OVERHEAD_US = 1.0  # a ring step inside a node of a multi-node ring: the proxy's network overhead (x3 Simple)
RING_BANDWIDTH = (0.5, 0.92, 1.0)  # of the bus bandwidth, per protocol
TREE_BANDWIDTH = (0.92 / 3.8, 0.92 * 120 / 128, 0.92)  # all-reduce's tree, across nodes
TREE_BANDWIDTH_ONE_NODE_LL128 = 0.92 * 7 / 9
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def collective_s(kind: str, nbytes: float, ranks: int, nodes: int, bandwidth: float, hw: str) -> tuple[float, str]:
    """(seconds, "algorithm/protocol") of one `kind` call moving `nbytes` (an all-gather's or reduce-scatter's
    whole tensor) among `ranks` GPUs over `nodes` nodes, `bandwidth` bytes/s a GPU on the slowest link crossed,
    `hw` the link inside a node ("nvlink" or "pci")."""
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}: one of {', '.join(KINDS)}")
    if ranks <= 1 or nbytes <= 0:
        return 0.0, "-"
    nodes = max(1, min(nodes, ranks))
    per_node = max(1, ranks // nodes)
    reduce = kind == "all_reduce"
    steps = 2 * (ranks - 1) if reduce else ranks - 1
    net_steps = (2 if reduce else 1) * (nodes - 1)
    choices = []
    for p, protocol in enumerate(PROTOCOLS):
        intra = HW_US[hw]["ring"][p]
        if nodes > 1:
            intra = max(intra, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
        # A GPU alone in its node (HSDP's replicas, one a node) leaves each network step's latency unhidden by
        # the steps inside a node: the tuner charges the tree's network latency for it.
        net = HW_US["net"]["tree" if per_node == 1 else "ring"][p]
        latency = BASE_US["ring"][p] + (steps - net_steps) * intra + net_steps * net
        wire = steps / ranks * nbytes / (bandwidth * RING_BANDWIDTH[p])
        choices.append((latency * 1e-6 + wire, f"ring/{protocol}"))
        if reduce:
            tree = BASE_US["tree"][p] + 2 * (
                (per_node - 1) * HW_US[hw]["tree"][p] + (nodes.bit_length() - 1) * HW_US["net"]["tree"][p]
            )
            share = TREE_BANDWIDTH_ONE_NODE_LL128 if nodes == 1 and protocol == "LL128" else TREE_BANDWIDTH[p]
            choices.append((tree * 1e-6 + 2 * nbytes / (bandwidth * share), f"tree/{protocol}"))
    return min(choices)
