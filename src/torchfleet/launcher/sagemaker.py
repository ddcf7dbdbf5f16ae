"""A SageMaker job without torch_distributed on a multi-GPU host: one worker per GPU."""

from __future__ import annotations

import os
import sys

from torchfleet.config import LaunchConfig
from torchfleet.launcher.agent import run_script


def relaunch_per_gpu(env) -> None:
    """Start this script once per GPU on this host, wait for the workers, and exit.

    Called by Fleet in the single process the toolkit starts on a multi-GPU host
    when the job has no `torch_distributed` (which would have started torchrun).
    The workers get torchrun's variables, so their Fleet finds its rank there;
    the master is algo-1 at SageMaker's port, as torchfleet.env derived it.
    """
    cfg = LaunchConfig(
        nproc_per_node=env.local_world_size,
        nnodes=env.nnodes,
        node_rank=env.node_rank,
        master_addr=env.master_addr,
        master_port=env.master_port,
    )
    # Every host's agent must name the same rendezvous run, or they never meet.
    os.environ.setdefault("TORCHFLEET_RUN_ID", "sagemaker-" + "-".join(map(str, (env.nnodes, env.master_port))))
    sys.exit(run_script(cfg, sys.argv[0], sys.argv[1:]))
