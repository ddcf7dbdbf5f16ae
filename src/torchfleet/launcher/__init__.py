"""Starting processes: torchrun's agent (agent.py) and what it is given (elastic_config.py), the
ports checked before it starts (ports.py), the loopback rendezvous, checks before a
multi-machine job (preflight.py), failure summaries (failures.py: the records the workers write,
read back here), the preemption signals handed on to the workers and their note read back
(preempt_relay.py), and the runners that cannot go through the agent (notebook.py, sagemaker.py;
hogwild's is hogwild/runner.py). What runs inside the workers is in worker/.

`run_command`, `run_script`, `launch` and `LaunchError` are importable from here; they load
the agent (and torch.distributed's elastic package) on first use, so a worker that only
needs failures.py does not pay for it.
"""

from __future__ import annotations

import importlib

# Each name's module: the agent's (and torch.distributed's elastic package), loaded on first use.
_LAZY = {
    "run_command": "torchfleet.launcher.agent",
    "run_script": "torchfleet.launcher.agent",
    "launch": "torchfleet.launcher.agent",
    "LaunchError": "torchfleet.launcher.agent",
    "free_port": "torchfleet.netif",
    "agent_config": "torchfleet.launcher.elastic_config",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchfleet.launcher' has no attribute {name!r}")
