"""Inside a SageMaker training job: the container's training environment, beyond ranks.

The sagemaker-training toolkit runs the entry point with SM_* variables
(SM_HOSTS, SM_CURRENT_HOST, SM_NUM_GPUS, SM_MODEL_DIR, SM_CHANNEL_*, SM_HPS,
...) and the hyper-parameters as `--name value` arguments; the same facts are
in /opt/ml/input/config/resourceconfig.json and hyperparameters.json.
torchfleet.env turns them into ranks; `TrainingEnv` gives the rest: where the
model, the data channels and the checkpoints go. (Writing a job is
torchfleet/clusters/sagemaker.py.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = "/opt/ml"
ROOT_VARIABLE = "TORCHFLEET_SAGEMAKER_ROOT"  # tests point it at a folder standing in for /opt/ml


def root(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    return Path(environ.get(ROOT_VARIABLE, DEFAULT_ROOT))


def resource_config_path(environ: Mapping[str, str]) -> Path:
    config_dir = environ.get("SM_INPUT_CONFIG_DIR") or str(root(environ) / "input" / "config")
    return Path(config_dir) / "resourceconfig.json"


@dataclass(frozen=True)
class TrainingEnv:
    """What a SageMaker training job gives its entry point, beyond ranks."""

    current_host: str
    hosts: tuple[str, ...]
    num_gpus: int
    model_dir: Path
    channels: dict[str, Path] = field(default_factory=dict)
    hyperparameters: dict = field(default_factory=dict)
    checkpoint_dir: Path | None = None  # /opt/ml/checkpoints, when the job configured one
    network_interface: str | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> TrainingEnv | None:
        """The training environment, or None outside a SageMaker job."""
        environ = os.environ if environ is None else environ
        base = root(environ)
        config_file = resource_config_path(environ)
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if "SM_HOSTS" not in environ and not config:
            return None
        hosts = json.loads(environ["SM_HOSTS"]) if "SM_HOSTS" in environ else config["hosts"]
        channels = {
            name[len("SM_CHANNEL_") :].lower(): Path(path)
            for name, path in environ.items()
            if name.startswith("SM_CHANNEL_")
        }
        checkpoints = base / "checkpoints"
        return cls(
            current_host=environ.get("SM_CURRENT_HOST") or config["current_host"],
            hosts=tuple(hosts),
            num_gpus=int(environ.get("SM_NUM_GPUS", "0")),
            model_dir=Path(environ.get("SM_MODEL_DIR") or base / "model"),
            channels=channels,
            hyperparameters=_hyperparameters(environ, base),
            checkpoint_dir=checkpoints if checkpoints.is_dir() else None,
            network_interface=environ.get("SM_NETWORK_INTERFACE_NAME") or config.get("network_interface_name"),
        )

    def needs_per_gpu_launch(self, environ: Mapping[str, str] | None = None) -> bool:
        """True in the one process the toolkit starts on a host with several GPUs
        (no `torch_distributed`): it must start one worker per GPU itself."""
        environ = os.environ if environ is None else environ
        return self.num_gpus > 1 and "LOCAL_RANK" not in environ


def _hyperparameters(environ: Mapping[str, str], base: Path) -> dict:
    if "SM_HPS" in environ:
        return json.loads(environ["SM_HPS"])
    path = base / "input" / "config" / "hyperparameters.json"
    # The file holds every value as a JSON-encoded string, as CreateTrainingJob sent it.
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return {key: decode_hyperparameter(value) for key, value in raw.items()}


def decode_hyperparameter(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value
