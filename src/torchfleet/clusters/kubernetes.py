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

With `--fault-tolerance step` (`manifests`) each pod is a replica group
under torchft instead: `torchfleet run --fault-tolerance step --node-rank
$(PET_NODE_RANK)`, meeting the others at a lighthouse that runs apart from the
job, in a Deployment of its own (1 replica, restarted by Kubernetes) behind a
Service `<job>-lighthouse`. A pod that fails is restarted alone (OnFailure)
and heals from a live peer while the other pods train on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from torchfleet.clusters import at_least, check_script, train_args
from torchfleet.config import FAULT_TOLERANCE
from torchfleet.errors import UsageError
from torchfleet.replica_groups.lighthouse import DEFAULT_PORT as LIGHTHOUSE_PORT

API_VERSION = "kubeflow.org/v1"
CONTAINER = "pytorch"  # the operator injects its variables into every container, and
PORT_NAME = "pytorchjob-port"  # reads MASTER_PORT from this named port of "pytorch"
PORT = 23456  # the operator's default for that port
DEFAULT_IMAGE = "torchfleet:latest"
# On SIGTERM (a preemption, an eviction, a deleted pod) torchrun's agent passes the signal to the
# workers and waits for them at most SHUTDOWN_SECONDS (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; its own default
# is 30 s); torchfleet train finishes the step, saves one checkpoint and exits 75, which the pods'
# restartPolicy OnFailure restarts (ExitCode would not: it takes 1-127 for permanent). Kubernetes
# SIGKILLs the pod GRACE_SECONDS after the SIGTERM (terminationGracePeriodSeconds, its default 30 s):
# room for a save of SHUTDOWN_SECONDS and the agent's own exit.
GRACE_SECONDS = 120
SHUTDOWN_SECONDS = 100
LIGHTHOUSE = "-lighthouse"  # the suffix of the lighthouse's Deployment and Service names
CREATED_BY = {"app.kubernetes.io/created-by": "torchfleet"}
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
    fault_tolerance: str = "restart"  # or "step": each pod a replica group under torchft (manifests)

    train: list[str] | None = field(init=False, default=None)  # train's arguments when script is "train"

    def __post_init__(self) -> None:
        # `train`: the built-in job, `torchfleet train SCRIPT_ARGS` (with --resume auto) under torchrun.
        self.train = train_args(self.script, self.script_args)
        if self.train is not None and self.fault_tolerance == "step":
            raise UsageError(
                "`train` under --fault-tolerance step is not written by torchfleet k8s; give a"
                " script (a Fleet script), or write a command of your own with torchfleet train"
                " --fault-tolerance step"
            )
        if self.train is None:
            check_script(self.script)
        # The pod runs the script from the image's working folder: keep the
        # path as the user gave it (relative paths are the usual case).
        self.script = Path(self.script).as_posix()
        at_least("--nodes", self.nodes, 1)
        at_least("--nproc-per-node", self.nproc_per_node, 1)
        at_least("--gpus-per-node", self.gpus_per_node, 0)
        if not self.image or any(c.isspace() for c in self.image):
            raise UsageError(
                f"--image {self.image!r} is not an image reference (expected e.g. registry.example.com/me/train:1)"
            )
        if self.fault_tolerance not in FAULT_TOLERANCE:
            raise UsageError(
                f"--fault-tolerance {self.fault_tolerance!r} is not a mode; choose restart (torchrun"
                " in every pod, one rendezvous) or step (each pod a replica group under torchft: the"
                " others go on when one fails)"
            )
        # Pod names add "-worker-<index>" (up to 10 more characters); 63 is the label limit.
        # Under step the Service "<job>-lighthouse" must be a DNS label too: 52 at most.
        most = 63 - len(LIGHTHOUSE) if self.fault_tolerance == "step" else 53
        if self.name is None:
            stem = re.sub(r"[^a-z0-9-]+", "-", Path(self.script).stem.lower()).strip("-")
            self.name = f"torchfleet-{stem}"[:most].rstrip("-")
        if not _DNS_LABEL.fullmatch(self.name) or len(self.name) > most:
            raise UsageError(
                f"job name {self.name!r} is not a DNS label of at most {most} characters "
                f"(lower-case letters, digits and '-')"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def lighthouse(self) -> str:
        """The lighthouse's Service (and Deployment) name, which the pods resolve in their namespace."""
        return f"{self.name}{LIGHTHOUSE}"


def _command(job: PyTorchJob) -> list[str]:
    # $(VAR) is expanded by the kubelet from the container's environment,
    # which holds what the operator injected. Passing the values as flags
    # works with every operator version (older ones set no PET_MASTER_*).
    if job.fault_tolerance == "step":
        # One group per pod: PET_NODE_RANK is the pod's index (Master 0, Worker i is i+1), the
        # group's. With --lighthouse given, --master-addr only picks the interface: the one
        # that reaches the lighthouse's Service.
        return [
            "python",
            "-m",
            "torchfleet",
            "run",
            "--fault-tolerance",
            "step",
            "--nnodes",
            str(job.nodes),
            "--node-rank",
            "$(PET_NODE_RANK)",
            "--master-addr",
            job.lighthouse,
            "--lighthouse",
            f"{job.lighthouse}:{LIGHTHOUSE_PORT}",
            "-n",
            str(job.nproc_per_node),
            job.script,
            *job.script_args,
        ]
    # torchrun's -m runs a module in every worker: torchfleet train, which trains in it (torchrun's variables).
    target = [job.script, *job.script_args] if job.train is None else ["-m", "torchfleet", "train", *job.train]
    return [
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes=$(PET_NNODES)",
        "--nproc-per-node=$(PET_NPROC_PER_NODE)",
        "--node-rank=$(PET_NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        *target,
    ]


def _container(job: PyTorchJob) -> dict:
    container = {
        "name": CONTAINER,
        "image": job.image,
        "command": _command(job),
        "ports": [{"name": PORT_NAME, "containerPort": PORT}],
        # How long torchrun's agent waits for the workers to save after a SIGTERM (GRACE_SECONDS).
        "env": [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(SHUTDOWN_SECONDS)}],
    }
    if job.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": job.gpus_per_node}}
    return container


def _replica(job: PyTorchJob, replicas: int) -> dict:
    return {
        "replicas": replicas,
        # OnFailure restarts a failed pod; torchrun's rendezvous then
        # waits for it, as a node restart does (under step: it heals from a live peer).
        "restartPolicy": "OnFailure",
        "template": {"spec": {"terminationGracePeriodSeconds": GRACE_SECONDS, "containers": [_container(job)]}},
    }


def manifest(job: PyTorchJob) -> dict:
    """The PyTorchJob object for `job`."""
    specs = {"Master": _replica(job, 1)}
    if job.nodes > 1:
        specs["Worker"] = _replica(job, job.nodes - 1)
    return {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": {"name": job.name, "labels": dict(CREATED_BY)},
        "spec": {
            "nprocPerNode": str(job.nproc_per_node),
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def lighthouse_manifests(job: PyTorchJob) -> list[dict]:
    """The lighthouse's Deployment and its Service `<job>-lighthouse`, for `--fault-tolerance step`.

    A Deployment, not a pod of the job: it outlives any pod of the PyTorchJob, and Kubernetes
    starts it again (restartPolicy Always) if it fails. It binds the pod's own IP (from the
    downward API), as `torchfleet lighthouse` binds the one address it is given.
    """
    select = {"app.kubernetes.io/name": job.lighthouse}

    def labels() -> dict:  # a new dict each time: PyYAML writes a shared one as an anchor and alias
        return {**select, **CREATED_BY}

    container = {
        "name": "lighthouse",
        "image": job.image,
        "command": ["python", "-m", "torchfleet", "lighthouse", "--host", "$(POD_IP)", "--port", str(LIGHTHOUSE_PORT)],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT, "protocol": "TCP"}],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": job.lighthouse, "labels": labels()},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": dict(select)},
            "template": {
                "metadata": {"labels": labels()},
                "spec": {"restartPolicy": "Always", "containers": [container]},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": job.lighthouse, "labels": labels()},
        "spec": {
            "selector": dict(select),
            "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT, "targetPort": "lighthouse", "protocol": "TCP"}],
        },
    }
    return [deployment, service]


def manifests(job: PyTorchJob) -> list[dict]:
    """Every object `job` needs, in the order to apply them: under step the lighthouse first."""
    if job.fault_tolerance == "step":
        return [*lighthouse_manifests(job), manifest(job)]
    return [manifest(job)]


def render_all(objs: list[dict]) -> str:
    """One object as `render` writes it; several as one multi-document YAML, or a JSON List."""
    if len(objs) == 1:
        return render(objs[0])
    try:
        import yaml
    except ImportError:
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, indent=2) + "\n"
    return yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False)


def render(obj: dict) -> str:
    """YAML when PyYAML is installed (`pip install torchfleet[k8s]`), else JSON, which
    kubectl reads just the same."""
    try:
        import yaml
    except ImportError:
        return json.dumps(obj, indent=2) + "\n"
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)
