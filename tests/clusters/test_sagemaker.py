"""SageMaker: the job `torchfleet sagemaker` writes, and a script running inside a job.

The training container's contract is emulated as the sagemaker-training toolkit
writes it: a folder per host stands in for /opt/ml (input/config/resourceconfig.json,
hyperparameters.json, input/data/<channel>, model, checkpoints), the SM_* variables
point into it, and the entry point runs as `python script.py --name value ...`. Two
network-namespace hosts named algo-1 and algo-2 (tests/netns.py), each with an
/etc/hosts naming both, as SageMaker's cluster DNS does, train together.
"""

from __future__ import annotations

import ast
import contextlib
import json
import shutil
import sys
from pathlib import Path

import pytest

import netns
import reference
from helpers import EXAMPLES, clean_env
from torchfleet.cli import main

SCRIPT = str(EXAMPLES / "train_digits.py")
HOSTS = ["algo-1", "algo-2"]


def _estimator_kwargs(path: Path) -> dict:
    """The keyword arguments of the PyTorch(...) call in the written estimator file."""
    tree = ast.parse(path.read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "PyTorch"]
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "role"}


def test_gpu_job_uses_torch_distributed(tmp_path, capsys):
    out = tmp_path / "job"
    assert (
        main(
            [
                "sagemaker",
                SCRIPT,
                "--instance-type",
                "ml.g5.12xlarge",
                "--instance-count",
                "2",
                "--role",
                "arn:aws:iam::111122223333:role/Trainer",
                "--out",
                str(out),
                "--",
                "--epochs",
                "3",
                "--lr",
                "0.001",
            ]
        )
        == 0
    )
    assert "8 processes (2 x ml.g5.12xlarge, torchrun on each host)" in capsys.readouterr().out
    kwargs = _estimator_kwargs(out / "estimator.py")
    assert kwargs == {
        "entry_point": "train_digits.py",
        "source_dir": str(EXAMPLES),
        "framework_version": "2.3.0",
        "py_version": "py311",
        "instance_type": "ml.g5.12xlarge",
        "instance_count": 2,
        "hyperparameters": {"epochs": 3, "lr": 0.001},
        "distribution": {"torch_distributed": {"enabled": True}},
        "base_job_name": "torchfleet-train-digits",
        "checkpoint_local_path": "/opt/ml/checkpoints",
    }
    assert "role = 'arn:aws:iam::111122223333:role/Trainer'" in (out / "estimator.py").read_text()
    request = json.loads((out / "create_training_job.json").read_text())
    assert request["ResourceConfig"] == {"InstanceType": "ml.g5.12xlarge", "InstanceCount": 2, "VolumeSizeInGB": 30}
    assert request["RoleArn"] == "arn:aws:iam::111122223333:role/Trainer"
    hps = request["HyperParameters"]
    assert all(isinstance(v, str) for v in hps.values())  # CreateTrainingJob takes strings
    assert {k: json.loads(v) for k, v in hps.items()} == {
        "epochs": 3,
        "lr": 0.001,
        "sagemaker_program": "train_digits.py",
        "sagemaker_submit_directory": "s3://<bucket>/torchfleet-train-digits/source/sourcedir.tar.gz",
        "sagemaker_region": "us-east-1",
        "sagemaker_container_log_level": 20,
        "sagemaker_torch_distributed_enabled": True,
    }
    assert request["AlgorithmSpecification"]["TrainingImage"].endswith("pytorch-training:2.3.0-gpu-py311")
    assert request["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"


def test_cpu_job_runs_one_process_per_host(tmp_path, capsys):
    assert (
        main(["sagemaker", SCRIPT, "--instance-type", "ml.c5.2xlarge", "--instance-count", "3", "--out", str(tmp_path)])
        == 0
    )
    assert "3 processes (3 x ml.c5.2xlarge, one process per host)" in capsys.readouterr().out
    assert _estimator_kwargs(tmp_path / "estimator.py")["distribution"] is None
    request = json.loads((tmp_path / "create_training_job.json").read_text())
    assert "sagemaker_torch_distributed_enabled" not in request["HyperParameters"]


BAD = [
    (["--instance-type", "g5.12xlarge"], "--instance-type 'g5.12xlarge' is not a SageMaker instance type"),
    (["--instance-type", "ml.g9.2xlarge"], "its GPU count is not known"),
    (["--instance-count", "0"], "--instance-count 0 must be at least 1"),
    (["--role", "Trainer"], "--role 'Trainer' is not an IAM role ARN"),
    (["--", "--epochs"], "are not `--name value` pairs"),
]


@pytest.mark.parametrize("flags,sentence", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input(flags, sentence, tmp_path, capsys):
    assert main(["sagemaker", SCRIPT, "--out", str(tmp_path), *flags]) == 2
    assert sentence in capsys.readouterr().err


def test_submit_without_the_sdk_is_one_sentence(tmp_path, capsys):
    pytest.importorskip("torchfleet")  # always there; the SDK is what must be missing
    if shutil.which("python") and _has_sagemaker():
        pytest.skip("the SageMaker SDK is installed here; --submit would really submit")
    assert main(["sagemaker", SCRIPT, "--out", str(tmp_path), "--submit"]) == 2
    err = capsys.readouterr().err
    assert "--submit needs the SageMaker Python SDK: pip install sagemaker" in err
    assert (tmp_path / "estimator.py").is_file()


def _has_sagemaker() -> bool:
    import importlib.util

    return importlib.util.find_spec("sagemaker") is not None


# --- inside a training job ----------------------------------------------------------


def _container(opt_ml: Path, host: str, num_gpus: int, hps: dict) -> dict[str, str]:
    """Lay out /opt/ml for `host` and return the SM_* variables, as the toolkit does."""
    config = opt_ml / "input" / "config"
    train = opt_ml / "input" / "data" / "train"
    for folder in (config, train, opt_ml / "model", opt_ml / "output" / "data"):
        folder.mkdir(parents=True, exist_ok=True)
    (config / "resourceconfig.json").write_text(
        json.dumps({"current_host": host, "hosts": HOSTS, "network_interface_name": "eth0"})
    )
    (config / "hyperparameters.json").write_text(json.dumps({k: json.dumps(v) for k, v in hps.items()}))
    return {
        "SM_HOSTS": json.dumps(HOSTS),
        "SM_CURRENT_HOST": host,
        "SM_NUM_GPUS": str(num_gpus),
        "SM_NUM_CPUS": "2",
        "SM_MODEL_DIR": str(opt_ml / "model"),
        "SM_INPUT_DIR": str(opt_ml / "input"),
        "SM_INPUT_CONFIG_DIR": str(config),
        "SM_OUTPUT_DATA_DIR": str(opt_ml / "output" / "data"),
        "SM_CHANNELS": '["train"]',
        "SM_CHANNEL_TRAIN": str(train),
        "SM_HPS": json.dumps(hps),
        "SM_USER_ARGS": json.dumps([x for k, v in hps.items() for x in (f"--{k}", str(v))]),
        "SM_NETWORK_INTERFACE_NAME": "eth0",
        "SM_CURRENT_INSTANCE_TYPE": "ml.g5.12xlarge",
        "TORCHFLEET_SAGEMAKER_ROOT": str(opt_ml),
    }


@contextlib.contextmanager
def _host_names(net: netns.Network):
    """/etc/netns/<ns>/hosts: `ip netns exec` mounts it over /etc/hosts in that namespace."""
    made = []
    try:
        for ns in net.names:
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            made.append(folder)
            lines = ["127.0.0.1 localhost"] + [f"{net.addr(i)} {h}" for i, h in enumerate(HOSTS)]
            (folder / "hosts").write_text("\n".join(lines) + "\n")
        yield
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(300)
def test_two_hosts_train_together_and_the_model_lands_in_the_model_dir(tmp_path):
    """algo-1 and algo-2, each "a 2-GPU instance" (SM_NUM_GPUS=2) without torch_distributed:
    the toolkit starts the script once per host, and the script starts its 2 workers per
    host itself (4 in all). No GPU here, so they run on CPU with Gloo; the launch is the same."""
    hps = {"epochs": int(reference.EPOCHS)}
    with netns.hosts(2) as net, _host_names(net):
        procs = []
        for i, host in enumerate(HOSTS):
            env = clean_env(**_container(tmp_path / host, host, num_gpus=2, hps=hps))
            args = [x for k, v in hps.items() for x in (f"--{k}", str(v))]
            procs.append(
                net.popen(i, [sys.executable, SCRIPT, *args], cwd=EXAMPLES, env=env, text=True, stdout=-1, stderr=-2)
            )
        reference.serial_weights()  # trains meanwhile
        logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    assert logs[0].count("epoch 1:") == 1 and "epoch 1:" not in logs[1]  # one main rank
    assert reference.close_to_serial(tmp_path / "algo-1" / "model" / "model.pt")
    assert list((tmp_path / "algo-2" / "model").iterdir()) == []  # the main rank alone writes


@pytest.mark.timeout(180)
def test_trainer_checkpoints_and_resumes_in_opt_ml(tmp_path, monkeypatch, capsys):
    """`torchfleet train` in a one-host job (run in this process: one rank, no group):
    checkpoints go to /opt/ml/checkpoints (when the job has it), the model to
    SM_MODEL_DIR, and a restarted job resumes."""
    opt_ml = tmp_path / "opt_ml"
    (opt_ml / "checkpoints").mkdir(parents=True)
    env = _container(opt_ml, "algo-1", num_gpus=0, hps={})
    env["SM_HOSTS"] = '["algo-1"]'
    for name, value in clean_env(**env).items():
        monkeypatch.setenv(name, value)
    flags = ["train", "--strategy", "serial", "--model", "mlp", "--max-steps", "3", "--no-progress"]
    assert main(flags) == 0
    assert [p.name for p in (opt_ml / "checkpoints").iterdir()] == ["step-00000003"]
    assert (opt_ml / "model" / "model.pt").is_file()
    capsys.readouterr()
    assert main(flags) == 0
    assert "resumed from" in capsys.readouterr().out


def test_training_env_reads_the_toolkit_contract(tmp_path):
    from torchfleet.env.sagemaker import TrainingEnv

    env = _container(tmp_path, "algo-2", num_gpus=4, hps={"epochs": 3, "lr": 0.01})
    found = TrainingEnv.read(env)
    assert (found.current_host, found.hosts, found.num_gpus) == ("algo-2", ("algo-1", "algo-2"), 4)
    assert found.model_dir == tmp_path / "model"
    assert found.channels == {"train": tmp_path / "input" / "data" / "train"}
    assert found.hyperparameters == {"epochs": 3, "lr": 0.01}
    assert (found.checkpoint_dir, found.network_interface) == (None, "eth0")
    assert found.needs_per_gpu_launch(env) and not found.needs_per_gpu_launch({**env, "LOCAL_RANK": "0"})
    # Without the toolkit's variables: resourceconfig.json and hyperparameters.json.
    (tmp_path / "checkpoints").mkdir()
    bare = TrainingEnv.read({"TORCHFLEET_SAGEMAKER_ROOT": str(tmp_path)})
    assert (bare.current_host, bare.hosts, bare.num_gpus) == ("algo-2", ("algo-1", "algo-2"), 0)
    assert bare.hyperparameters == {"epochs": 3, "lr": 0.01}  # decoded from JSON strings
    assert (bare.model_dir, bare.checkpoint_dir) == (tmp_path / "model", tmp_path / "checkpoints")
    assert TrainingEnv.read({"TORCHFLEET_SAGEMAKER_ROOT": str(tmp_path / "elsewhere")}) is None
