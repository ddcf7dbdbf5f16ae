"""pytest's hooks and the fixtures every folder of tests/ shares; the helpers are in helpers.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from helpers import torchfleet


def pytest_configure(config) -> None:
    """SIGTERM and SIGINT stop the run as Ctrl-C does: KeyboardInterrupt in pytest's own process, so the test's
    children are killed (subprocess.run kills its child on any exception) and fixtures stop what they started
    (a Slurm cluster's daemons, which leave their process group). SIGINT too, because `make test` starts one
    of its two runs in the background, where the shell makes it ignore SIGINT. A process forked from this
    one (forked_torchfleet) keeps the default action: only pytest's process raises."""
    main = os.getpid()

    def stop(signum, frame) -> None:
        if os.getpid() != main:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)


@pytest.fixture
def cli():
    return torchfleet


@pytest.fixture(scope="session")
def good_checkpoint(tmp_path_factory):
    """A directory holding one intact checkpoint (serial, mlp, AdamW, synthetic data, step 2)."""
    from torchfleet.train.config import TrainConfig
    from torchfleet.train.loop import train

    directory = tmp_path_factory.mktemp("good") / "ckpt"
    train(
        TrainConfig(
            strategy="serial",
            model="mlp",
            data="synthetic",
            synthetic_size=256,
            max_steps=2,
            progress=False,
            checkpoint_dir=str(directory),
            hang_timeout=0,
        ),
        "serial",
    )
    return directory
