"""`torchfleet k8s`: a PyTorchJob manifest that the CRD's schema accepts, and pods that train.

The schema is the PyTorchJob CRD's openAPIV3Schema (tests/data/pytorchjob.v1.schema.json
says where it comes from and how it was reduced). Kubernetes rejects fields a structural
schema does not name (kubectl's strict field validation); `_strict` makes jsonschema do the
same, so a misspelt field fails here as it would there.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import reference
from conftest import ROOT, clean_env
from torchfleet.cli import main
from torchfleet.launcher.agent import free_port

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev extra")
yaml = pytest.importorskip("yaml", reason="pyyaml is in the dev extra")

SCHEMA = json.loads((Path(__file__).parent / "data" / "pytorchjob.v1.schema.json").read_text())
SCRIPT = "examples/train_digits.py"  # relative: the image's working folder holds it


def _strict(schema):
    """A copy of an OpenAPI structural schema that refuses fields it does not name."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


VALIDATOR = jsonschema.Draft7Validator(_strict(SCHEMA))


def _write(tmp_path, *flags) -> dict:
    out = tmp_path / "job.yaml"
    assert main(["k8s", SCRIPT, "--out", str(out), *flags]) == 0
    return yaml.safe_load(out.read_text())


def _errors(obj) -> list[str]:
    return [e.message for e in VALIDATOR.iter_errors(obj)]


def test_manifest_validates_against_the_pytorchjob_schema(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    job = _write(tmp_path, "--nodes", "3", "--nproc-per-node", "4", "--gpus-per-node", "4",
                 "--image", "registry.example.com/me/train:1", "--", "--epochs", "3")
    assert _errors(job) == []
    assert "PyTorchJob torchfleet-train-digits, 12 processes (3 pod(s) x 4)" in capsys.readouterr().out
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    spec = job["spec"]
    assert spec["nprocPerNode"] == "4"
    replicas = spec["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 2}
    for replica in replicas.values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the operator reads its port from this one
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 4}}
        assert container["image"] == "registry.example.com/me/train:1"
        assert container["command"][-3:] == [SCRIPT, "--epochs", "3"]


def test_one_node_has_only_a_master(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    job = _write(tmp_path)
    assert _errors(job) == []
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert "resources" not in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_the_schema_catches_what_the_api_server_would(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    good = _write(tmp_path, "--nodes", "2")
    broken = copy.deepcopy(good)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    broken["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"] = [{"image": "x"}]
    broken["spec"]["runPolicy"]["cleanPodPolicyy"] = "None"
    errors = _errors(broken)
    assert any("'one' is not of type 'integer'" in e for e in errors)
    assert any("'name' is a required property" in e for e in errors)
    assert any("'cleanPodPolicyy' was unexpected" in e for e in errors)
    del broken["spec"]["pytorchReplicaSpecs"]
    assert any("'pytorchReplicaSpecs' is a required property" in e for e in _errors(broken))


def test_bad_input(capsys):
    assert main(["k8s", SCRIPT, "--nodes", "0"]) == 2
    assert "--nodes 0 must be at least 1" in capsys.readouterr().err
    assert main(["k8s", SCRIPT, "--image", "my image"]) == 2
    assert "--image 'my image' is not an image reference" in capsys.readouterr().err


def _operator_env(job: dict, replica: str, index: int, master_port: int) -> dict[str, str]:
    """What training-operator injects into a pod's container (controller.v1/pytorch
    envvar.go and master.go), with the master's service name swapped for 127.0.0.1: the
    pods here are processes on this machine."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in specs.values())
    nproc = int(job["spec"]["nprocPerNode"])
    rank = index + 1 if replica == "Worker" else index
    return {"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(master_port), "MASTER_ADDR": "127.0.0.1",
            "WORLD_SIZE": str(pods * nproc), "RANK": str(rank), "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": str(nproc), "PET_NNODES": str(pods)}


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@pytest.mark.timeout(300)
def test_pods_train_like_one_process(tmp_path, monkeypatch):
    """Each pod runs the manifest's command with the operator's variables; the two
    pods' processes train together to the serial weights."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "k8s.pt"
    job = _write(tmp_path, "--nodes", "2", "--", "--epochs", reference.EPOCHS, "--out", str(out))
    port = free_port()
    pods = []
    for replica, index in (("Master", 0), ("Worker", 0)):
        env = _operator_env(job, replica, index, port)
        (container,) = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"]
        command = [_expand(arg, env) for arg in container["command"]]
        assert command[0] == "python"
        pods.append(subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, text=True,
                                     env=clean_env(**env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT))
    reference.serial_weights()  # trains while the pods do
    logs = [pod.communicate(timeout=240)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(logs)
    assert logs[0].count("epoch 1:") == 1 and "epoch 1:" not in logs[1]  # rank 0 is the master's
    assert reference.max_difference(out) < 1e-5
