"""A one-machine rendezvous that listens on loopback only.

torchrun's c10d rendezvous hosts its TCPStore with `TCPStore(host, port,
is_master=True)`, and that server binds the wildcard address ([::] or
0.0.0.0) whatever `host` says: `host` only tells clients where to connect.
The agent then starts a second store for the workers (the "shared" store of
`DynamicRendezvousHandler._create_tcp_store_server`), bound the same way. So
`torchrun --standalone` opens two ports to the whole network.

TCPStore also accepts `master_listen_fd`: a socket the caller has already
bound and put into listening state. This backend binds both stores to
127.0.0.1 that way and otherwise is torch's own c10d rendezvous
(`C10dRendezvousBackend` + `DynamicRendezvousHandler`), registered under
`LOOPBACK_BACKEND` in torch's handler registry.
"""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from torchfleet.stores import bound_store

LOOPBACK = "127.0.0.1"
LOOPBACK_BACKEND = "torchfleet-loopback"
_STORE_TIMEOUT = datetime.timedelta(seconds=60)


def _method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up, as torch's `get_method_name` gives it for the rendezvous
    handler's event records, read off the frame. torch's calls `inspect.stack()`, which finds the source file
    and module of every frame on the stack (a walk over sys.modules), twice a record and several records a
    launch: with transformers imported, and under a planner's deep stack, that was a tenth of `plan --check`."""
    try:
        return sys._getframe(depth).f_code.co_name  # frame 0 is this one, as inspect.stack()[0] is torch's
    except ValueError:  # a shorter stack: torch's answer for it
        return "no_method_name"


if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
    dynamic_rendezvous.get_method_name = _method_name


def loopback_store(port: int = 0) -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1:`port` only (0: the OS picks a port)."""
    return bound_store(LOOPBACK, port, _STORE_TIMEOUT)


class _LoopbackHandler(DynamicRendezvousHandler):
    def get_backend(self) -> str:
        return LOOPBACK_BACKEND  # the registry checks that the handler is the one asked for

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        # The workers' store: torch binds it to every address; here, loopback.
        return loopback_store(master_port)


def _create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = loopback_store(port)
    backend = C10dRendezvousBackend(store, params.run_id)
    return _LoopbackHandler.from_backend(params.run_id, store, backend, params.min_nodes, params.max_nodes, LOOPBACK)


def register() -> str:
    """Make the backend known to torch's agent (idempotent); returns its name."""
    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create_handler)
    return LOOPBACK_BACKEND


# Many machines, elastic: torch's c10d rendezvous, with one change. Its handler works out where
# the workers' store is (the machine of node rank 0) in the first round and keeps that on every
# other machine; when the rank-0 machine is lost, the survivors' restarted workers knock on its
# dead address until they time out (torch 2.14), or the machine that becomes rank 0 fails an
# assertion, having no store server (2.11). Forgetting it before each round makes rank 0 open
# the store and publish its address in that round's keys, and every machine read it afresh.
ELASTIC_BACKEND = "torchfleet-c10d"


class _ElasticHandler(DynamicRendezvousHandler):
    def get_backend(self) -> str:
        return ELASTIC_BACKEND  # the registry checks that the handler is the one asked for

    def next_rendezvous(self):
        self._bootstrap_store_info = None
        return super().next_rendezvous()


def _create_elastic_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    # torch's own c10d handler (registry._create_c10d_handler), so every --rdzv-conf option
    # (timeouts, heartbeats, is_host) is read as torch reads it; only the class is ours.
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    handler.__class__ = _ElasticHandler
    return handler


def register_elastic() -> str:
    """Make the elastic backend known to torch's agent (idempotent); returns its name."""
    rendezvous_handler_registry.register(ELASTIC_BACKEND, _create_elastic_handler)
    return ELASTIC_BACKEND
