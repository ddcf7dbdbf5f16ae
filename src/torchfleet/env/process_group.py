"""Joining the job's process group from what the environment says (Fleet's, once per process)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from torchfleet import netif
from torchfleet.backend import choose_socket_interface
from torchfleet.env.dist_env import DistEnv
from torchfleet.env.name_lookup import absorb_failed_lookup_warning

# How long a collective may wait before the process group gives up. Long
# enough for a slow first step; issue-level hang detection is the watchdog's job.
PG_TIMEOUT = datetime.timedelta(minutes=10)


def join_process_group(env: DistEnv, backend: str) -> None:
    if dist.is_initialized():
        return
    # Before the first of this process's c10d sockets (nothing where the job's address is loopback).
    absorb_failed_lookup_warning(netif.source_address(env.master_addr))
    if env.source == "torchrun" and env.restart_count > 0:
        # After a restart torchrun's agent hands out the same store as before, where
        # each rank's Gloo address from the last attempt still sits (torch says it makes
        # a new store per attempt; its rendezvous caches the first). A prefix per attempt
        # keeps this attempt's keys apart.
        store = dist.PrefixStore(
            f"torchfleet/attempt-{env.restart_count}",
            dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=PG_TIMEOUT),
        )
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=PG_TIMEOUT)
        return
    # torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT.
    init_method = "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
    choose_socket_interface(env.nnodes, env.master_addr)
    dist.init_process_group(
        backend, init_method=init_method, rank=env.rank, world_size=env.world_size, timeout=PG_TIMEOUT
    )
