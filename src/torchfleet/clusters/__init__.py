"""Job specifications for the schedulers people already have.

One module per target, each turning a script and a few numbers into the file
that scheduler takes: `slurm` (an sbatch script), `sagemaker` (an estimator
definition and its CreateTrainingJob request), `kubernetes` (a Kubeflow
PyTorchJob manifest). They write text; none of them starts a process.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchfleet import outputs
from torchfleet.errors import UsageError
from torchfleet.outputs import check_writable_file


def check_script(script: str) -> Path:
    """The training script as an absolute path; a UsageError if it is not a Python file."""
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"script {script!r} does not exist; give the path to a Python file")
    if path.suffix != ".py":
        raise UsageError(f"script {script!r} is not a Python file (.py)")
    return path.resolve()


TRAIN = "train"  # in place of a script: the built-in job, `torchfleet train` with the script's arguments


def train_args(script: str, script_args: list[str], requeue: bool = False, flag: str = "--requeue") -> list[str] | None:
    """`torchfleet train`'s arguments when `script` is "train", else None (a script of the user's).

    With --checkpoint-dir among them, `--resume auto` is added unless a --resume flag is
    there already: the job started again (requeued, a pod restarted) runs the same command
    and continues from the newest checkpoint, and the first run starts from the beginning.
    """
    if script != TRAIN:
        return None
    given = {a.split("=", 1)[0] for a in script_args}
    if requeue and "--checkpoint-dir" not in given:
        raise UsageError(
            f"{flag} needs --checkpoint-dir among train's arguments (after --): the job saves"
            " there on the signal and resumes from there when requeued"
        )
    if "--checkpoint-dir" in given and not given & {"--resume", "--resume-fallback"}:
        return [*script_args, "--resume", "auto"]
    return list(script_args)


def at_least(flag: str, value: int, low: int) -> None:
    if value < low:
        raise UsageError(f"{flag} {value} must be at least {low}")


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` (creating its folder); a UsageError if that is impossible."""
    path = check_writable_file(path, "--out")
    outputs.write_text(path, text, "--out")
    return path
