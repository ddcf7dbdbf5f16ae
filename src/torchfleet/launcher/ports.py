"""The ports a launch needs, checked before any process starts: free where it listens, answering where it joins."""

from __future__ import annotations

import socket

from torchfleet import netif
from torchfleet.config import LaunchConfig
from torchfleet.errors import UsageError
from torchfleet.netif import LOOPBACK

MASTER_WAIT = 60.0  # seconds a node waits for node 0's rendezvous to answer


def check_port_free(host: str, port: int, endpoint: str | None = None) -> None:
    """UsageError when `port` is taken, before any process starts (`endpoint`: the
    --rdzv-endpoint that names it, where that flag chose the port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            if endpoint:
                raise UsageError(
                    f"--rdzv-endpoint {endpoint}: port {port} is already in use on this machine"
                    f" ({exc.strerror}); choose another port"
                ) from None
            raise UsageError(
                f"--master-port {port} is already in use on {host} ({exc.strerror}); choose another"
                " port, or leave --master-port out on one machine for a free one"
            ) from None


def wait_for_master(addr: str, port: int, wait: float = MASTER_WAIT) -> None:
    """UsageError when node 0's rendezvous at addr:port cannot be reached within `wait` seconds."""
    try:
        netif.wait_reachable(addr, port, wait, interval=1.0)
    except socket.gaierror as exc:
        raise UsageError(
            f"--master-addr {addr!r} cannot be resolved ({exc.strerror}); give node 0's host name or IP address"
        ) from None
    except OSError as exc:
        raise UsageError(
            f"cannot reach the master at {addr}:{port} within {wait:.0f} s ({exc.strerror or exc});"
            " check --master-addr and --master-port, and that node 0 has started"
        ) from None


def check_ports(cfg: LaunchConfig) -> None:
    """Refuse what would only fail later, slowly: a busy port, an unreachable master."""
    if not cfg.multi_node:
        if cfg.master_port:
            check_port_free(LOOPBACK, cfg.master_port)
        return
    if cfg.elastic:
        # Not node_rank, which is 0 on every elastic machine until the rendezvous assigns it: that
        # had each machine check the master port (29500), which the job never opens. The store
        # opens on the endpoint's port, on the machine the endpoint names.
        host, port = cfg.endpoint
        if netif.is_local(host):
            check_port_free("0.0.0.0", port, endpoint=f"{host}:{port}")
        return
    if cfg.node_rank == 0:
        check_port_free("0.0.0.0", cfg.master_port or 29500)
    elif not cfg.preflight:
        # Without the preflight's checks, still refuse to wait forever on a master nobody answers at.
        wait_for_master(cfg.master_addr, cfg.master_port or 29500)
