"""SageMaker training jobs: the estimator and the CreateTrainingJob request that start one.

What a job's container sees (ranks, `TrainingEnv`) is read in
torchfleet/env/sagemaker.py; this module writes the job.

`torchfleet sagemaker script.py --instance-type ml.g5.12xlarge --instance-count 2`
writes `estimator.py` (a sagemaker.pytorch.PyTorch estimator) and
`create_training_job.json` (the request the SDK sends for it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from torchfleet.clusters import at_least, check_script
from torchfleet.env.sagemaker import (
    TrainingEnv,  # noqa: F401 - the reading side, kept importable here
    decode_hyperparameter,
)
from torchfleet.errors import UsageError

# --- writing the job ---------------------------------------------------------------

FRAMEWORK_VERSION = "2.3.0"  # a PyTorch training container with torch_distributed (torchrun)
PY_VERSION = "py311"
REGION = "us-east-1"
# The account that publishes the AWS Deep Learning Containers in most regions.
DLC_ACCOUNT = "763104351884"
ROLE_PLACEHOLDER = "arn:aws:iam::123456789012:role/SageMakerExecutionRole"

# GPUs per instance for the families people train on (AWS's instance-type pages).
_GPUS = {
    "ml.p3.2xlarge": 1,
    "ml.p3.8xlarge": 4,
    "ml.p3.16xlarge": 8,
    "ml.p3dn.24xlarge": 8,
    "ml.p4d.24xlarge": 8,
    "ml.p4de.24xlarge": 8,
    "ml.p5.48xlarge": 8,
    "ml.g4dn.xlarge": 1,
    "ml.g4dn.2xlarge": 1,
    "ml.g4dn.4xlarge": 1,
    "ml.g4dn.8xlarge": 1,
    "ml.g4dn.16xlarge": 1,
    "ml.g4dn.12xlarge": 4,
    "ml.g5.xlarge": 1,
    "ml.g5.2xlarge": 1,
    "ml.g5.4xlarge": 1,
    "ml.g5.8xlarge": 1,
    "ml.g5.16xlarge": 1,
    "ml.g5.12xlarge": 4,
    "ml.g5.24xlarge": 4,
    "ml.g5.48xlarge": 8,
}
_INSTANCE = re.compile(r"ml\.([a-z]+)(\d+)([a-z]*)\.(\d*x?large|metal)")


def gpus_of(instance_type: str) -> int:
    """GPUs on `instance_type`: 0 for CPU families, the table's count for GPU ones."""
    match = _INSTANCE.fullmatch(instance_type)
    if match is None:
        raise UsageError(
            f"--instance-type {instance_type!r} is not a SageMaker instance type "
            f"(expected e.g. ml.g5.12xlarge or ml.c5.2xlarge)"
        )
    if instance_type in _GPUS:
        return _GPUS[instance_type]
    if match.group(1) in ("p", "g"):
        raise UsageError(
            f"--instance-type {instance_type!r}: its GPU count is not known to "
            f"torchfleet; use one of {', '.join(sorted(_GPUS))}, or a CPU type"
        )
    return 0


def hyperparameters_from_args(args: list[str]) -> dict:
    """`--epochs 3 --lr 0.1` -> {"epochs": 3, "lr": 0.1}: the toolkit passes them back as
    `--epochs 3 --lr 0.1`, so the script sees the arguments it was given."""
    if len(args) % 2 or not all(a.startswith("--") and len(a) > 2 for a in args[::2]):
        raise UsageError(
            f"script arguments {' '.join(args)!r} are not `--name value` pairs; "
            f"SageMaker passes hyper-parameters only in that form"
        )
    return {name[2:]: decode_hyperparameter(value) for name, value in zip(args[::2], args[1::2], strict=True)}


@dataclass
class SageMakerJob:
    script: str
    script_args: list[str] = field(default_factory=list)
    instance_type: str = "ml.g5.12xlarge"
    instance_count: int = 1
    role: str | None = None

    def __post_init__(self) -> None:
        self.script = str(check_script(self.script))
        at_least("--instance-count", self.instance_count, 1)
        self.gpus = gpus_of(self.instance_type)
        self.hyperparameters = hyperparameters_from_args(self.script_args)
        if self.role is not None and not self.role.startswith("arn:"):
            raise UsageError(
                f"--role {self.role!r} is not an IAM role ARN (expected arn:aws:iam::<account>:role/<name>)"
            )
        self.base_name = "torchfleet-" + re.sub(r"[^a-zA-Z0-9-]+", "-", Path(self.script).stem)

    @property
    def distribution(self) -> dict | None:
        # torch_distributed: the container starts torchrun with one worker per GPU on every
        # host (master algo-1, port 7777). CPU instances get no distribution: the toolkit
        # runs the script once per host, and Fleet reads SM_HOSTS / SM_CURRENT_HOST.
        return {"torch_distributed": {"enabled": True}} if self.gpus else None

    @property
    def processes(self) -> int:
        return self.instance_count * max(1, self.gpus)


def estimator_source(job: SageMakerJob) -> str:
    """A Python file defining `estimator`; running it submits the job."""
    kwargs = {
        "entry_point": Path(job.script).name,
        "source_dir": str(Path(job.script).parent),
        "framework_version": FRAMEWORK_VERSION,
        "py_version": PY_VERSION,
        "instance_type": job.instance_type,
        "instance_count": job.instance_count,
        "hyperparameters": job.hyperparameters,
        "distribution": job.distribution,
        "base_job_name": job.base_name,
        # Synced with S3 while the job runs; Fleet resumes from it after a Spot interruption.
        "checkpoint_local_path": "/opt/ml/checkpoints",
    }
    body = ",\n".join(f"    {name}={value!r}" for name, value in kwargs.items())
    role = repr(job.role) if job.role else 'os.environ.get("SAGEMAKER_ROLE") or sagemaker.get_execution_role()'
    return f'''"""A SageMaker training job for {Path(job.script).name}, written by `torchfleet sagemaker`.

{job.processes} processes: {job.instance_count} x {job.instance_type} ({job.gpus} GPU(s) each).
Submit with `python {{this file}}` (needs `pip install sagemaker` and AWS credentials),
or send create_training_job.json, the same request, with `aws sagemaker create-training-job`.
"""

import os

import sagemaker
from sagemaker.pytorch import PyTorch

role = {role}

estimator = PyTorch(
    role=role,
{body},
)

if __name__ == "__main__":
    estimator.fit(wait=False)
    print(estimator.latest_training_job.name)
'''


def create_training_job_request(job: SageMakerJob) -> dict:
    """The CreateTrainingJob request the estimator sends (SDK v2): hyper-parameters are
    JSON-encoded strings, and the sagemaker_* ones tell the container what to run."""
    hps = dict(job.hyperparameters)
    hps.update(
        {
            "sagemaker_program": Path(job.script).name,
            "sagemaker_submit_directory": f"s3://<bucket>/{job.base_name}/source/sourcedir.tar.gz",
            "sagemaker_region": REGION,
            "sagemaker_container_log_level": 20,
        }
    )
    if job.distribution:
        hps["sagemaker_torch_distributed_enabled"] = True
    device = "gpu" if job.gpus else "cpu"
    return {
        "TrainingJobName": f"{job.base_name}-<timestamp>",
        "RoleArn": job.role or ROLE_PLACEHOLDER,
        "AlgorithmSpecification": {
            "TrainingImage": f"{DLC_ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/pytorch-training:"
            f"{FRAMEWORK_VERSION}-{device}-{PY_VERSION}",
            "TrainingInputMode": "File",
        },
        "HyperParameters": {name: json.dumps(value) for name, value in hps.items()},
        "ResourceConfig": {
            "InstanceType": job.instance_type,
            "InstanceCount": job.instance_count,
            "VolumeSizeInGB": 30,
        },
        "OutputDataConfig": {"S3OutputPath": "s3://<bucket>/"},
        "CheckpointConfig": {"S3Uri": f"s3://<bucket>/{job.base_name}/checkpoints", "LocalPath": "/opt/ml/checkpoints"},
        "StoppingCondition": {"MaxRuntimeInSeconds": 86400},
    }


def submit(estimator_file: Path) -> int:
    """Run the estimator file (estimator.fit); a UsageError if the SDK is missing."""
    import importlib.util
    import runpy

    if importlib.util.find_spec("sagemaker") is None:
        raise UsageError(
            "--submit needs the SageMaker Python SDK: pip install sagemaker "
            f"(or torchfleet[sagemaker]); {str(estimator_file)!r} is written"
        )
    runpy.run_path(str(estimator_file), run_name="__main__")
    return 0
