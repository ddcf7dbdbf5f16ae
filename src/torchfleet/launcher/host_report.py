"""`torchfleet doctor --master-addr A [--master-port P --nnodes N --node-rank R]`: this host's way to the master.

The interface and address that reach the master, the socket variables a launched job's workers get, and,
given a port, the preflight (launcher/preflight.py) with every other machine. The machine's own report is
doctor.py's.
"""

from __future__ import annotations

import json
import os

from torchfleet import netif
from torchfleet.launcher import preflight


def multinode_report(master: str, port: int | None, nnodes: int, node_rank: int) -> dict:
    """The interface to the master, the socket variables workers get, and the preflight.

    The route and the port are checked before the preflight touches torch.distributed,
    so a wrong address costs only the knock (4 s) after start-up, and a port nothing listens on the time node
    0 may take to start (the preflight's join wait, 60 s unless set).
    """
    iface = netif.interface_for(master)
    report = {
        "master": master,
        "interface": iface.name if iface else None,
        "address": netif.source_address(master),
        "socket_env": {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if os.environ.get(k)},
        "socket_env_set_by_torchfleet": preflight.route_env(node_rank, master),
    }
    if port is not None:
        # Gloo picks its interface from GLOO_SOCKET_IFNAME as the test all-reduce's group is made. A launched job's
        # agent sets it; doctor, run by hand, sets the interface to the master, not what the host name resolves to.
        os.environ.update(report["socket_env_set_by_torchfleet"])
        report["preflight"] = preflight.run(master, port, node_rank, nnodes).sentence(node_rank)
    return report


def print_multinode(master: str, port: int | None, nnodes: int = 1, node_rank: int = 0, json_out: bool = False) -> int:
    """Exit 0 when every check passed; a failed check raises PreflightError (exit 2)."""
    report = multinode_report(master, port, nnodes, node_rank)
    if json_out:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"interface to the master {report['master']}: {report['interface']}"
        f" (this machine's address there: {report['address']})"
    )
    for key, value in report["socket_env"].items():
        print(f"{key}={value} (set by you; kept)")
    for key, value in report["socket_env_set_by_torchfleet"].items():
        print(f"{key}={value} (torchfleet sets it for the workers)")
    if "preflight" in report:
        print(report["preflight"])
    return 0
