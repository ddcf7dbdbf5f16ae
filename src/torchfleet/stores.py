"""TCPStore servers that listen on one address, not on every one.

`TCPStore(host, port, is_master=True)` binds the wildcard address ([::] or
0.0.0.0) whatever `host` says: `host` only tells clients where to connect.
TCPStore also accepts `master_listen_fd`, a socket the caller has already
bound and put into listening state; `bound_store` binds it to `host` that way.
torchfleet's one-machine rendezvous keeps its stores on 127.0.0.1 with it
(launcher/rendezvous.py), and a replica group under per-step fault tolerance
opens torchft's store on the job's interface only (replica_groups/per_step.py).
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

STORE_TIMEOUT = datetime.timedelta(seconds=60)


def bound_store(host: str, port: int = 0, timeout: datetime.timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """A TCPStore server listening on `host`:`port` only (0: the OS picks a port; `.port` says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    port = sock.getsockname()[1]
    # detach(): the store owns the descriptor from now on; the Python object
    # must not close it when it is garbage collected.
    return dist.TCPStore(
        host, port, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach()
    )
