"""What torchrun's agent is given: its LaunchConfig, built from ours as torchrun would, and the workers' environment."""

from __future__ import annotations

import os
import uuid
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig as AgentConfig

from torchfleet import netif
from torchfleet.config import LaunchConfig
from torchfleet.launcher import preflight, rendezvous
from torchfleet.launcher.ports import LOOPBACK


def agent_config(
    cfg: LaunchConfig, overrides: dict[str, Any] | None = None, start_method: str = "spawn"
) -> AgentConfig:
    """torchrun's configuration for `cfg`, as torchrun itself would build it (`start_method`: a function
    entrypoint's; a command's workers are always new processes)."""
    run_id = cfg.rdzv_id or os.environ.get("TORCHFLEET_RUN_ID")
    if not cfg.multi_node:
        # One machine: like `torchrun --standalone`, a c10d rendezvous on a port
        # the OS picks, but its stores listen on loopback only (see rendezvous.py).
        backend, endpoint, local_addr = rendezvous.register(), f"{LOOPBACK}:{cfg.master_port or 0}", LOOPBACK
        rdzv_configs: dict[str, Any] = {}
        run_id = run_id or uuid.uuid4().hex[:12]
    elif cfg.elastic:
        host, port = cfg.endpoint
        # torch's c10d, re-reading where the workers' store is each round (rendezvous.py).
        backend, endpoint = rendezvous.register_elastic(), f"{host}:{port}"
        # torch decides who hosts the store by comparing the endpoint with the
        # host name's address; where the host name resolves to 127.0.0.1 no
        # machine would host it. Whether the endpoint is one of ours is exact.
        rdzv_configs = {"is_host": netif.is_local(host)}
        # The node that becomes rank 0 advertises local_addr as the workers'
        # MASTER_ADDR; torch's default, the FQDN, may resolve to 127.0.0.1.
        local_addr = netif.source_address(host)
        run_id = run_id or "torchfleet"  # must be the same on every machine
    else:
        # Many machines: torchrun's static rendezvous at the master's address.
        backend = "static"
        endpoint = f"{cfg.master_addr}:{cfg.master_port or 29500}"
        rdzv_configs = {"rank": cfg.node_rank}
        local_addr = netif.source_address(cfg.master_addr)
        run_id = run_id or "torchfleet"
    fields: dict[str, Any] = dict(
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=run_id,
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=cfg.max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(),
    )
    # torchrun flags torchfleet does not handle itself, as torchrun would apply them.
    overrides = dict(overrides or {})
    if "rdzv_configs" in overrides:
        # --rdzv-conf adds to the rendezvous options above instead of replacing them: replaced,
        # the c10d host lost `is_host` and, as its host name resolves to 127.0.0.1 on many
        # machines, nobody hosted the store and every node timed out connecting to it. "rank"
        # is torchrun's own parse of its --node-rank, which torchfleet reads itself (it is 0
        # there on every node), so the static rendezvous keeps ours.
        theirs = {k: v for k, v in overrides.pop("rdzv_configs").items() if k != "rank"}
        fields["rdzv_configs"] = {**rdzv_configs, **theirs}
    return AgentConfig(**{**fields, **overrides})


def socket_env(cfg: LaunchConfig) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for the workers, where the user set none.

    Without them Gloo advertises the address the host name resolves to, often
    127.0.0.1, and ranks on other machines never connect. Many machines: the
    interface that routes to the master. One machine: loopback, so nothing
    listens on the network.
    """
    if cfg.multi_node:
        return preflight.route_env(node_in_messages(cfg), cfg.endpoint[0])
    else:
        lo = next((i.name for i in netif.list_interfaces() if i.is_loopback), None)
        wanted = {"GLOO_SOCKET_IFNAME": lo} if lo else {}
    return {k: v for k, v in wanted.items() if not os.environ.get(k)}


def node_in_messages(cfg: LaunchConfig) -> int | None:
    """This machine's node rank for messages; None where the c10d rendezvous assigns it later
    (every elastic machine would otherwise call itself node 0)."""
    return None if cfg.elastic else cfg.node_rank


def worker_env(cfg: LaunchConfig) -> dict[str, str]:
    """What the agent's environment gets for its workers (and gives back after the run)."""
    chosen = socket_env(cfg)
    # As torchrun does: several processes on one host each get one intra-op
    # thread unless the user chose, or they fight over the same cores.
    if cfg.nproc_per_node > 1 and not os.environ.get("OMP_NUM_THREADS"):
        chosen["OMP_NUM_THREADS"] = "1"
    return chosen
