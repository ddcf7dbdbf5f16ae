"""`torchfleet k8s`: a PyTorchJob manifest that the CRD's schema accepts, and pods that train.

The schema is the PyTorchJob CRD's openAPIV3Schema (tests/fixtures/pytorchjob.v1.schema.json
says where it comes from and how it was reduced). Kubernetes rejects fields a structural
schema does not name (kubectl's strict field validation); `_strict` makes jsonschema do the
same, so a misspelt field fails here as it would there.

Under `--fault-tolerance step` the manifest holds three documents: the lighthouse's
Deployment and Service (checked field by field: kind, apiVersion, the selector that
must match the pod's labels, the ports, the downward-API address) and the PyTorchJob,
which the same schema validates; its pods and the lighthouse then run here as processes.
"""

from __future__ import annotations

import builtins
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import reference
from helpers import ROOT, clean_env, require_module
from torchfleet.cli import main
from torchfleet.netif import free_port

jsonschema = require_module("jsonschema", "jsonschema is in the dev extra")
yaml = require_module("yaml", "pyyaml is in the dev extra")

SCHEMA = json.loads((Path(__file__).parents[1] / "fixtures" / "pytorchjob.v1.schema.json").read_text())
SCRIPT = "examples/train_digits.py"  # relative: the image's working folder holds it
FT_SCRIPT = "tests/scripts/ft_seeds.py"  # a Fleet script for replica groups


def _strict(schema):
    """A copy of an OpenAPI structural schema that refuses fields it does not name."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
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
    job = _write(
        tmp_path,
        "--nodes",
        "3",
        "--nproc-per-node",
        "4",
        "--gpus-per-node",
        "4",
        "--image",
        "registry.example.com/me/train:1",
        "--",
        "--epochs",
        "3",
    )
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
    assert main(["k8s", SCRIPT, "--fault-tolerance", "always"]) == 2
    err = capsys.readouterr().err
    assert "--fault-tolerance 'always' is not a mode; choose restart" in err and len(err.strip().splitlines()) == 1


def _ft_documents(tmp_path, *flags) -> list[dict]:
    out = tmp_path / "job.yaml"
    assert main(["k8s", SCRIPT, "--fault-tolerance", "step", "--out", str(out), *flags]) == 0
    return list(yaml.safe_load_all(out.read_text()))


def _subset(small: dict, big: dict) -> bool:
    return all(big.get(k) == v for k, v in small.items())


def _check_lighthouse(deployment: dict, service: dict, image: str) -> None:
    """What the API server and kube-proxy need of the two: the kinds, a selector that matches the
    pods' labels (apps/v1 refuses a Deployment whose selector does not), a port that reaches the pod's."""
    assert (deployment["apiVersion"], deployment["kind"]) == ("apps/v1", "Deployment")
    assert (service["apiVersion"], service["kind"]) == ("v1", "Service")
    name = service["metadata"]["name"]
    assert deployment["metadata"]["name"] == name and re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name)
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] and _subset(spec["selector"]["matchLabels"], labels)
    assert service["spec"]["selector"] and _subset(service["spec"]["selector"], labels)
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Always"
    (container,) = pod["containers"]
    assert container["image"] == image
    assert container["command"] == [
        "python",
        "-m",
        "torchfleet",
        "lighthouse",
        "--host",
        "$(POD_IP)",
        "--port",
        "29510",
    ]
    assert container["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert container["ports"] == [{"name": "lighthouse", "containerPort": 29510, "protocol": "TCP"}]
    assert service["spec"]["ports"] == [
        {"name": "lighthouse", "port": 29510, "targetPort": "lighthouse", "protocol": "TCP"}
    ]


def test_ft_manifest_adds_a_lighthouse_and_runs_one_replica_group_per_pod(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    image = "registry.example.com/me/train:1"
    documents = _ft_documents(
        tmp_path,
        "--nodes",
        "3",
        "--nproc-per-node",
        "2",
        "--gpus-per-node",
        "2",
        "--image",
        image,
        "--",
        "--epochs",
        "3",
    )
    assert [d["kind"] for d in documents] == ["Deployment", "Service", "PyTorchJob"]
    deployment, service, job = documents
    _check_lighthouse(deployment, service, image)
    assert service["metadata"]["name"] == "torchfleet-train-digits-lighthouse"
    assert (
        "one replica group each; the lighthouse's Deployment and Service torchfleet-train-digits-lighthouse"
        in capsys.readouterr().out
    )
    assert _errors(job) == []
    assert job["metadata"]["name"] == "torchfleet-train-digits"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {k: (v["replicas"], v["restartPolicy"]) for k, v in replicas.items()} == {
        "Master": (1, "OnFailure"),
        "Worker": (2, "OnFailure"),
    }
    for kind, replica in replicas.items():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["command"] == [
            "python",
            "-m",
            "torchfleet",
            "run",
            "--fault-tolerance",
            "step",
            "--nnodes",
            "3",
            "--node-rank",
            "$(PET_NODE_RANK)",
            "--master-addr",
            "torchfleet-train-digits-lighthouse",
            "--lighthouse",
            "torchfleet-train-digits-lighthouse:29510",
            "-n",
            "2",
            SCRIPT,
            "--epochs",
            "3",
        ]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 2}}
        # The operator gives each pod its own index there: one group per pod, 0 to 2.
        assert [
            _expand("$(PET_NODE_RANK)", _operator_env(job, kind, i, 23456)) for i in range(replica["replicas"])
        ] == (["0"] if kind == "Master" else ["1", "2"])


def test_ft_manifest_keeps_the_lighthouse_service_a_dns_label(tmp_path):
    script = tmp_path / ("a_very_long_training_script_name_" * 3 + ".py")
    script.write_text("")
    out = tmp_path / "long.yaml"
    assert main(["k8s", str(script), "--fault-tolerance", "step", "--out", str(out)]) == 0
    deployment, service, job = yaml.safe_load_all(out.read_text())
    assert len(job["metadata"]["name"]) == 52 and len(service["metadata"]["name"]) == 63
    _check_lighthouse(deployment, service, "torchfleet:latest")
    assert _errors(job) == []


def test_ft_manifest_without_pyyaml_is_a_json_list(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    real_import = builtins.__import__

    def no_yaml(name, *args, **kwargs):
        if name == "yaml":
            raise ImportError("No module named 'yaml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    out = tmp_path / "job.json"
    assert main(["k8s", SCRIPT, "--fault-tolerance", "step", "--nodes", "2", "--out", str(out)]) == 0
    listed = json.loads(out.read_text())
    assert (listed["apiVersion"], listed["kind"]) == ("v1", "List")
    assert [item["kind"] for item in listed["items"]] == ["Deployment", "Service", "PyTorchJob"]
    _check_lighthouse(*listed["items"][:2], "torchfleet:latest")
    assert _errors(listed["items"][2]) == []


def _operator_env(job: dict, replica: str, index: int, master_port: int) -> dict[str, str]:
    """What training-operator injects into a pod's container (controller.v1/pytorch
    envvar.go and master.go), with the master's service name swapped for 127.0.0.1: the
    pods here are processes on this machine."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in specs.values())
    nproc = int(job["spec"]["nprocPerNode"])
    rank = index + 1 if replica == "Worker" else index
    return {
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": str(master_port),
        "MASTER_ADDR": "127.0.0.1",
        "WORLD_SIZE": str(pods * nproc),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NNODES": str(pods),
    }


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@pytest.mark.slow
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
        pods.append(
            subprocess.Popen(
                [sys.executable, *command[1:]],
                cwd=ROOT,
                text=True,
                env=clean_env(**env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    reference.serial_weights()  # trains while the pods do
    logs = [pod.communicate(timeout=240)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(logs)
    assert logs[0].count("epoch 1:") == 1 and "epoch 1:" not in logs[1]  # rank 0 is the master's
    assert reference.max_difference(out) < 1e-5


@pytest.mark.timeout(180)
def test_ft_pods_meet_at_the_lighthouse_and_train(tmp_path, monkeypatch):
    """The lighthouse Deployment's command with the pod's IP, and each pod's command with the
    operator's variables, as processes here (the Service's name swapped for 127.0.0.1, its port
    for a free one): the groups reach the lighthouse and train together to the end."""
    require_module("torchft", "--fault-tolerance step needs torchft (the dev extra installs it)")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "job.yaml"
    assert main(["k8s", FT_SCRIPT, "--fault-tolerance", "step", "--nodes", "2", "--out", str(out)]) == 0
    deployment, service, job = yaml.safe_load_all(out.read_text())
    name, port = service["metadata"]["name"], free_port()

    def local(command: list[str], env: dict[str, str]) -> list[str]:
        swapped = [_expand(arg, env).replace(f"{name}:29510", f"127.0.0.1:{port}") for arg in command]
        assert swapped[0] == "python"
        return [sys.executable, *(str(port) if a == "29510" else "127.0.0.1" if a == name else a for a in swapped[1:])]

    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    lighthouse = subprocess.Popen(
        local(container["command"], {"POD_IP": "127.0.0.1"}),
        cwd=ROOT,
        text=True,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    pods = []
    try:
        for replica, index in (("Master", 0), ("Worker", 0)):
            env = _operator_env(job, replica, index, free_port())
            (container,) = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"]
            pods.append(
                subprocess.Popen(
                    local(container["command"], env),
                    cwd=ROOT,
                    text=True,
                    env=clean_env(**env),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        logs = [pod.communicate(timeout=150)[0] for pod in pods]
    finally:
        for pod in pods:
            pod.kill()
        lighthouse.terminate()
        said = lighthouse.communicate(timeout=30)[0]
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(logs)
    assert f"lighthouse listening on http://127.0.0.1:{port}" in said, said
    for group, log in enumerate(logs):
        assert f"the lighthouse at 127.0.0.1:{port} answers" in log, log
        assert f"replica group {group} of 2" in log, log


def _write_train(tmp_path, *flags) -> dict:
    out = tmp_path / "train.yaml"
    assert main(["k8s", "train", "--out", str(out), *flags]) == 0
    return yaml.safe_load(out.read_text())


TRAIN_ARGS = [
    "--model",
    "mlp",
    "--data",
    "synthetic",
    "--synthetic-size",
    "512",
    "--batch-size",
    "32",
    "--no-progress",
    "--hang-timeout",
    "0",
]  # 16 steps an epoch


def test_train_manifest_gives_a_grace_period_for_a_save_and_resumes_auto(tmp_path, monkeypatch):
    """`k8s train`: torchfleet train under torchrun with --resume auto, every pod a grace period that holds
    torchrun's wait for the save (its shutdown timeout, set below it), and OnFailure, which restarts the
    preempted pod's exit (75 from the workers; torchrun's own on SIGTERM)."""
    monkeypatch.chdir(ROOT)
    job = _write_train(tmp_path, "--nodes", "2", "--", *TRAIN_ARGS, "--checkpoint-dir", "/ck")
    assert _errors(job) == []
    assert job["metadata"]["name"] == "torchfleet-train"
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert replica["restartPolicy"] == "OnFailure"
        assert pod["terminationGracePeriodSeconds"] == 120
        (container,) = pod["containers"]
        assert container["env"] == [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "100"}]
        assert container["command"][:2] == ["python", "-m"] and "torch.distributed.run" in container["command"]
        assert container["command"][-len(TRAIN_ARGS) - 7 :] == [
            "-m",
            "torchfleet",
            "train",
            *TRAIN_ARGS,
            "--checkpoint-dir",
            "/ck",
            "--resume",
            "auto",
        ]
    # A script of the user's keeps its command, and gets the grace period too.
    script = _write(tmp_path)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert script["terminationGracePeriodSeconds"] == 120 and script["containers"][0]["command"][-1] == SCRIPT
    # Without --checkpoint-dir there is nothing to resume: no --resume added.
    bare = _write_train(tmp_path, "--", "--epochs", "1")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert bare["containers"][0]["command"][-3:] == ["train", "--epochs", "1"]
    assert main(["k8s", "train", "--fault-tolerance", "step"]) == 2


@pytest.mark.timeout(240)
def test_a_train_pod_told_sigterm_saves_and_its_restart_resumes(tmp_path, monkeypatch):
    """The pod's command (torchrun, 2 workers of torchfleet train) with the operator's variables and the
    container's env, as a process here: SIGTERM to it, as the kubelet sends it to the container's
    first process, mid-run; the same command again, as OnFailure restarts the pod, continues from the
    checkpoint, and the final weights equal an uninterrupted serial run's."""
    import os
    import signal
    import time

    import torch

    from torchfleet.train.config import TrainConfig
    from torchfleet.train.loop import train

    monkeypatch.chdir(ROOT)
    ck, marker, final = tmp_path / "ck", tmp_path / "fired", tmp_path / "final.pt"
    job = _write_train(
        tmp_path,
        "--nproc-per-node",
        "2",
        "--",
        *TRAIN_ARGS,
        "--checkpoint-dir",
        str(ck),
        "--max-steps",
        "20",
        "--save-model",
        str(final),
    )
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    given = {e["name"]: e["value"] for e in container["env"]}

    def pod() -> subprocess.Popen:
        env = {
            **_operator_env(job, "Master", 0, free_port()),
            **given,
            "TORCHFLEET_FAULT": f"sleep:rank=0:step=6:seconds=1:once={marker}",
        }
        command = [_expand(arg, env) for arg in container["command"]]
        return subprocess.Popen(
            [sys.executable, *command[1:]],
            cwd=ROOT,
            text=True,
            env=clean_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    first = pod()
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    sent = time.monotonic()
    os.kill(first.pid, signal.SIGTERM)
    out, err = first.communicate(timeout=110)
    seconds = time.monotonic() - sent
    assert first.returncode != 0, out + err  # a failure to OnFailure: the pod restarts
    assert f"torchfleet: preempted by SIGTERM at step 10, checkpoint saved to {ck / 'step-00000010'}" in err, err
    second = pod()
    out2, err2 = second.communicate(timeout=150)
    assert second.returncode == 0, out2 + err2
    assert f"resumed from {ck / 'step-00000010'} at step 10" in out2, out2
    train(
        TrainConfig(
            strategy="serial",
            model="mlp",
            data="synthetic",
            synthetic_size=512,
            batch_size=32,
            progress=False,
            hang_timeout=0,
            max_steps=20,
            save_model=str(tmp_path / "straight.pt"),
        ),
        "serial",
    )
    a, b = torch.load(final, weights_only=True), torch.load(tmp_path / "straight.pt", weights_only=True)
    difference = max((a[k] - b[k]).abs().max().item() for k in a)
    print(
        f"\nk8s pod: SIGTERM to exit {seconds:.1f} s (status {first.returncode}); max weight difference"
        f" {difference:.3g}"
    )
    assert difference < 1e-5
