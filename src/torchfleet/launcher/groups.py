"""Launching one replica group of a job under per-step fault tolerance (`--fault-tolerance step`).

Each machine runs its own group: torchrun's agent with this machine's
processes only (a one-machine rendezvous on loopback, as `--nnodes 1`), so a
lost machine takes no other machine's workers with it, and `--max-restarts`
restarts only this group, which then heals from a live peer. Across machines
the groups meet through torchft's lighthouse, which node 0's launcher starts
at `--master-addr`:`--master-port` (29510 unless given) unless `--lighthouse`
names one started elsewhere (`torchfleet lighthouse`).

Before its workers start, a group checks that the lighthouse answers (one
sentence after 30 s if it does not), and tells its workers where they stand
(env/replicas.py): the lighthouse, their group, the number of groups, and
this machine's address on the interface that reaches the lighthouse, which
torchft's manager, its store and Gloo bind to and advertise (never a host name,
which often resolves to 127.0.0.1 on such machines).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchfleet import netif
from torchfleet.config import LaunchConfig, parse_endpoint
from torchfleet.env.replicas import ReplicaEnv
from torchfleet.errors import UsageError
from torchfleet.launcher import preflight
from torchfleet.replica_groups import lighthouse, torchft_setup


@dataclasses.dataclass
class Group:
    """What `prepare` settled: the agent's one-machine config, the workers' variables, the lighthouse it runs."""

    agent: LaunchConfig
    env: dict[str, str]
    sentence: str  # what the preflight found, for the launcher to print
    exposure: str  # what this machine opens to the network
    server: Any = None  # node 0's lighthouse: kept alive until the job ends


def endpoint(cfg: LaunchConfig) -> tuple[str, int]:
    """Where the lighthouse is: --lighthouse, else node 0 at --master-addr and --master-port (29510)."""
    if cfg.lighthouse is not None:
        return parse_endpoint(cfg.lighthouse, lighthouse.DEFAULT_PORT, "--lighthouse")
    return cfg.master_addr, cfg.master_port or lighthouse.DEFAULT_PORT


def prepare(cfg: LaunchConfig) -> Group:
    reason = torchft_setup.unavailable()
    if reason:
        raise UsageError(f"--fault-tolerance step cannot run here: {reason}")
    host, port = endpoint(cfg)
    iface = preflight.route(cfg.node_rank, host)
    address = netif.source_address(host)
    if address is None:
        raise UsageError(f"node {cfg.node_rank}: no route to the lighthouse's host {host}")
    address = address.split("%")[0]
    server = None
    if cfg.lighthouse is None and cfg.node_rank == 0:
        server = lighthouse.start(host, port)
        seconds = 0.0
        found = f"the lighthouse listens on {host}:{port}"
    else:
        seconds = lighthouse.wait_reachable(host, port)
        found = f"the lighthouse at {host}:{port} answers ({seconds:.1f} s)"
    replica = ReplicaEnv(
        lighthouse=lighthouse.url(host, port),
        group=cfg.node_rank,
        groups=cfg.max_nodes,
        addr=address,
        join_timeout=cfg.join_timeout,
    )
    env = {**replica.variables(), **preflight.route_env(cfg.node_rank, host)}
    sentence = (
        f"preflight ok on {preflight.label(cfg.node_rank, address)} via {iface.name}: {found};"
        f" replica group {cfg.node_rank} of {cfg.max_nodes}"
    )
    exposure = (
        f"torchfleet: node {cfg.node_rank} "
        + (f"exposes torchft's lighthouse on {host}:{port} and " if server is not None else "")
        + f"opens torchft's manager, its store and Gloo on {address} (TCP ports chosen by the OS, no"
        " authentication); they hand the model's weights to any group that asks: run the job on a"
        " private network (docs/guides/security.md)"
    )
    # The agent sees one machine: its own workers, a loopback rendezvous, its own restarts.
    agent = dataclasses.replace(
        cfg,
        nnodes=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=None,
        fault_tolerance="restart",
        lighthouse=None,
        rdzv_endpoint=None,
    )
    return Group(agent=agent, env=env, sentence=sentence, exposure=exposure, server=server)
