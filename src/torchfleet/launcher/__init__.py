"""Starting processes: torchrun's agent (agent.py), the loopback rendezvous, checks before a
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

_AGENT = ("run_command", "run_script", "launch", "LaunchError", "free_port", "agent_config")


def __getattr__(name: str):
    if name in _AGENT:
        return getattr(importlib.import_module("torchfleet.launcher.agent"), name)
    raise AttributeError(f"module 'torchfleet.launcher' has no attribute {name!r}")
