"""c10d's reverse lookup of socket addresses, and the one warning it prints where no DNS server answers.

torch's c10d names the far end of every socket it connects (a TCPStore, the
rendezvous) by a reverse lookup of its address (getnameinfo). Where no DNS
server answers, as on many clusters' private networks, in containers and in
network namespaces, the lookup fails, and torch 2.14 says so once a process
before it stops looking names up:

    [W... socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3

Nothing is wrong and there is nothing to do: torch goes on with the numeric
address. Every torchfleet process that joins a job (the launcher, each worker)
would print it, so each takes that warning first, on purpose: it opens
throwaway stores on its own address on the job's network and on loopback with
its stderr captured, prints again whatever else was written meanwhile, and
drops the line. Its later sockets then go unnamed, as they would have after the
warning. Lookups that succeed print nothing; the stores cost milliseconds.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

from torchfleet.versions import release

NOISE = "[c10d] The hostname of the client socket cannot be retrieved"


def absorb_failed_lookup_warning(address: str | None = None) -> None:
    """Take c10d's once-a-process warning about a failed reverse lookup now, silently, by connecting stores on
    `address` (this machine's address on the job's network) and on loopback: inside a network namespace
    without DNS even 127.0.0.1 fails, as c10d connects to it as the IPv6 address ::ffff:127.0.0.1. Nothing
    before torch 2.14 (which warns on every failed lookup, so taking one would not stop the next), or with
    TORCHFLEET_VERBOSE set."""
    if release() < (2, 14) or os.environ.get("TORCHFLEET_VERBOSE"):
        return
    from torchfleet.stores import bound_store

    with dropping_lines(NOISE):
        hosts: list[str] = [address.split("%")[0]] if address else []
        for host in dict.fromkeys([*hosts, "127.0.0.1"]):
            try:
                # The store's own client connects to it at `host`, and c10d names that connection's far end.
                bound_store(host, 0, timeout=datetime.timedelta(seconds=10))  # and closed at once
            except Exception:  # noqa: BLE001 - an address the job will fail on is reported by the job itself
                pass


@contextlib.contextmanager
def dropping_lines(text: str):
    """Everything written to file descriptor 2 inside the block (by C++ too), printed after it but for the lines
    holding `text`. Python's own stderr is flushed first, so nothing written before is caught or reordered."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if text.encode() not in line]
            if kept:
                os.write(2, b"".join(kept))
