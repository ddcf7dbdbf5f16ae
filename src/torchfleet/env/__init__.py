"""The one environment contract: which process this is, and where the others are.

``DistEnv.detect()`` reads the variables a launcher sets, once, in a fixed
order (torchrun, a Kubeflow PyTorchJob pod, Slurm, MPI, SageMaker, else one process) and returns a frozen
``DistEnv``. Nothing else in torchfleet reads these variables: code that needs
the rank is handed a ``DistEnv``. ``torch_env()`` gives them back in torchrun's
words, which is what ``init_process_group(init_method="env://")`` reads:

    env = DistEnv.detect()
    os.environ.update(env.torch_env())
    torch.distributed.init_process_group(backend, init_method="env://")

DistEnv and its detectors are in dist_env.py, Slurm's layout in slurm_layout.py, the
variables read as typed values (and EnvError) in variables.py. This package must stay
cheap to import: no torch.
"""

from __future__ import annotations

from torchfleet.env.dist_env import DistEnv, detect
from torchfleet.env.slurm_layout import expand_hostlist
from torchfleet.env.variables import EnvError

__all__ = ["DistEnv", "EnvError", "detect", "expand_hostlist"]
