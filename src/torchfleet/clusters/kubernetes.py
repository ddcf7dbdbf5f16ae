"""A Kubeflow PyTorchJob manifest for a torchfleet script.

    torchfleet k8s train.py --nodes 2 --nproc-per-node 4 --image registry/me/train:1 --out job.yaml
    kubectl apply -f job.yaml

One pod per node: the Master replica (node 0) and nodes-1 Worker replicas. The
training operator gives every pod MASTER_ADDR (the master pod's service),
MASTER_PORT (the container port named "pytorchjob-port"), WORLD_SIZE, RANK
(the pod's index) and, for torchrun, PET_NNODES, PET_NODE_RANK and
PET_NPROC_PER_NODE (kubeflow/training-operator, pkg/controller.v1/pytorch/
envvar.go and master.go). Each pod runs torchrun with those values, and
torchrun gives every process its RANK and LOCAL_RANK, which Fleet reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from torchfleet.clusters import at_least, check_script
from torchfleet.errors import UsageError

API_VERSION = "kubeflow.org/v1"
CONTAINER = "pytorch"  # the operator injects its variables into every container, and
PORT_NAME = "pytorchjob-port"  # reads MASTER_PORT from this named port of "pytorch"
PORT = 23456  # the operator's default for that port
DEFAULT_IMAGE = "torchfleet:latest"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass
class PyTorchJob:
    script: str
    script_args: list[str] = field(default_factory=list)
    nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    image: str = DEFAULT_IMAGE
    name: str | None = None

    def __post_init__(self) -> None:
        check_script(self.script)
        # The pod runs the script from the image's working folder: keep the
        # path as the user gave it (relative paths are the usual case).
        self.script = Path(self.script).as_posix()
        at_least("--nodes", self.nodes, 1)
        at_least("--nproc-per-node", self.nproc_per_node, 1)
        at_least("--gpus-per-node", self.gpus_per_node, 0)
        if not self.image or any(c.isspace() for c in self.image):
            raise UsageError(f"--image {self.image!r} is not an image reference "
                             f"(expected e.g. registry.example.com/me/train:1)")
        if self.name is None:
            stem = re.sub(r"[^a-z0-9-]+", "-", Path(self.script).stem.lower()).strip("-")
            self.name = f"torchfleet-{stem}"[:53].rstrip("-")
        # Pod names add "-worker-<index>" (up to 10 more characters); 63 is the label limit.
        if not _DNS_LABEL.fullmatch(self.name) or len(self.name) > 53:
            raise UsageError(f"job name {self.name!r} is not a DNS label of at most 53 characters "
                             f"(lower-case letters, digits and '-')")

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


def _container(job: PyTorchJob) -> dict:
    # $(VAR) is expanded by the kubelet from the container's environment,
    # which holds what the operator injected. Passing the values as flags
    # works with every operator version (older ones set no PET_MASTER_*).
    command = ["python", "-m", "torch.distributed.run",
               "--nnodes=$(PET_NNODES)", "--nproc-per-node=$(PET_NPROC_PER_NODE)",
               "--node-rank=$(PET_NODE_RANK)", "--master-addr=$(MASTER_ADDR)",
               "--master-port=$(MASTER_PORT)", job.script, *job.script_args]
    container = {
        "name": CONTAINER,
        "image": job.image,
        "command": command,
        "ports": [{"name": PORT_NAME, "containerPort": PORT}],
    }
    if job.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": job.gpus_per_node}}
    return container


def _replica(job: PyTorchJob, replicas: int) -> dict:
    return {
        "replicas": replicas,
        # OnFailure restarts a failed pod; torchrun's rendezvous then
        # waits for it, as a node restart does.
        "restartPolicy": "OnFailure",
        "template": {"spec": {"containers": [_container(job)]}},
    }


def manifest(job: PyTorchJob) -> dict:
    """The PyTorchJob object for `job`."""
    specs = {"Master": _replica(job, 1)}
    if job.nodes > 1:
        specs["Worker"] = _replica(job, job.nodes - 1)
    return {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": {"name": job.name, "labels": {"app.kubernetes.io/created-by": "torchfleet"}},
        "spec": {
            "nprocPerNode": str(job.nproc_per_node),
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def render(obj: dict) -> str:
    """YAML when PyYAML is installed (`pip install torchfleet[k8s]`), else JSON, which
    kubectl reads just the same."""
    try:
        import yaml
    except ImportError:
        return json.dumps(obj, indent=2) + "\n"
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)
