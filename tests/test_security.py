"""What a run exposes, and what it refuses to unpickle (docs/guides/security.md)."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from torchfleet import Fleet, UsageError, checkpoint, launch
from torchfleet.config import LaunchConfig
from torchfleet.launcher.agent import exposure


def _listening(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on, read from /proc."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address = fields[1].split(":")[0]
                found.append({"0100007F": "127.0.0.1", "00000000000000000000000001000000": "::1"}.get(address, address))
    return found


def _worker_and_agent_listeners():
    torch.distributed.init_process_group("gloo")  # Gloo's own listening sockets exist once the group is up
    found = _listening([os.getpid(), os.getppid()])
    torch.distributed.destroy_process_group()
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
@pytest.mark.timeout(400)  # two processes and a group: seconds alone, minutes under CI's two lanes
def test_one_machine_listens_on_loopback_only():
    for found in launch(_worker_and_agent_listeners, nprocs=2):
        assert found, "no listening socket seen: the check would prove nothing"
        assert set(found) <= {"127.0.0.1", "::1"}, found


def test_many_machines_say_what_they_expose():
    text = exposure(LaunchConfig(nnodes=2, node_rank=0, master_port=29511))
    assert "every interface, port 29511" in text and "no authentication" in text and "private network" in text
    joiner = exposure(LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29511))
    assert "10.0.0.1:29511" in joiner


class Payload:
    """Not a tensor or a plain value: unpickling it needs weights_only=False."""

    def __init__(self, text):
        self.text = text


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _fleet():
    fleet = Fleet(strategy="serial")
    net = torch.nn.Linear(3, 2)
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return fleet


def _reseal(path: Path, name: str) -> None:
    """Rewrite the manifest's checksum, as an attacker with write access could."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = checkpoint.sha256(path / name)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_arbitrary_objects_load_only_when_the_user_asks(tmp_path):
    fleet = _fleet()
    fleet.save(tmp_path / "step-00000001", step=1, note=Payload("hello"))
    with pytest.raises(UsageError, match="weights_only=False only if you trust its source"):
        fleet.load(tmp_path / "step-00000001")
    assert fleet.load(tmp_path / "step-00000001", weights_only=False)["note"].text == "hello"


@pytest.mark.parametrize("name", ["ranks.pt", "model/.metadata"])
def test_a_pickle_that_runs_code_is_refused_and_never_runs(tmp_path, name):
    fleet = _fleet()
    path = tmp_path / "step-00000001"
    fleet.save(path, sharded=True, step=1)  # a DCP checkpoint: its .metadata is a pickle
    marker = tmp_path / "pwned"
    (path / name).write_bytes(pickle.dumps(RunsCode(marker)))
    _reseal(path, name)
    with pytest.raises(UsageError) as info:
        fleet.load(path)
    assert "\n" not in str(info.value)
    assert not marker.exists()
