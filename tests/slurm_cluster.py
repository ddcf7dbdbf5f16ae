"""A one-node Slurm cluster on this machine, for tests: munged, slurmctld and slurmd.

    with slurm_cluster.running() as cluster:
        job_id = cluster.sbatch(path)
        state, exit_code = cluster.wait(job_id, timeout=180)

Everything lives in a fresh temporary folder (config, state, spool, logs, the
munge key and socket) and the daemons listen on free ports, so the machine's
own /etc/slurm and any real cluster are left alone. The node is this host
with 2 CPUs, which two jobs may share (OverSubscribe=FORCE:2: the requeue test runs two
jobs side by side, their waits overlapping), and the settings need no cgroups (proctrack/linuxproc,
task/none), so it runs in containers. The daemons are always stopped, even
when the test fails. Where something is missing, the test is skipped with
the reason (failed under TORCHFLEET_REQUIRE_SYSTEM_TESTS=1: helpers.require_system).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "sinfo", "scontrol", "squeue", "srun")


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge; `make system-deps` does it)"
        )
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "slurmd must run as root to start job tasks as their user"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Cluster:
    root: Path
    node: str

    @property
    def env_extra(self) -> dict[str, str]:
        """What a client needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **self.env_extra}

    def command(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_which(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout, env=self.env
        )

    def wait(self, job_id: str, timeout: float) -> tuple[str, str]:
        """Wait for the job to end; (JobState, ExitCode) as scontrol shows them."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.command("scontrol", "show", "job", job_id).stdout
            fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
            state = fields.get("JobState", "UNKNOWN")
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN"):
                return state, fields.get("ExitCode", "?")
            if time.monotonic() > deadline:
                self.command("scancel", job_id)
                raise TimeoutError(f"job {job_id} still {state} after {timeout} s\n{self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*")))


def _config(root: Path, node: str) -> str:
    return f"""\
ClusterName=torchfleet
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket,cred_expire=20
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=600
KillWait=5
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
"""


def _pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().split()[0])
    return None


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (daemons are reparented to an init that may never reap
    them, in containers) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _stop(pid_files: list[Path]) -> None:
    """SIGTERM each daemon we started (by its pid file), then SIGKILL what is left."""
    pids = [pid for pid in map(_pid, pid_files) if pid]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for pid in pids:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start(cmd: list[str], env: dict[str, str], what: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{what} did not start: {out.stderr.strip() or out.returncode}")


@contextlib.contextmanager
def running(skip: bool = True, idle_timeout: float = 30):
    """Yield a started `Cluster` whose node is idle; stop its daemons afterwards."""
    reason = unavailable_reason()
    if reason is not None:
        if not skip:
            raise RuntimeError(reason)
        from helpers import require_system  # skips, or fails where CI demands these tests

        require_system(f"cannot start a Slurm cluster: {reason}")
    # A short path: the munge socket path must fit in sun_path (108 bytes).
    root = Path(tempfile.mkdtemp(prefix="tfslurm-"))
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "log", "munge"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o755)  # clients must reach the socket
    key = root / "munge" / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (root / "slurm.conf").write_text(_config(root, node))
    cluster = Cluster(root, node)
    pid_files = [root / "slurmd.pid", root / "slurmctld.pid", root / "munge" / "pid"]
    try:
        try:
            _boot(cluster, key, idle_timeout)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            if not skip:
                raise
            from helpers import require_system

            require_system(f"cannot start a Slurm cluster: {exc}")
        yield cluster
    finally:
        _stop(pid_files)
        shutil.rmtree(root, ignore_errors=True)


def _boot(cluster: Cluster, key: Path, idle_timeout: float) -> None:
    root = cluster.root
    _start(
        [
            _which("munged"),
            "--force",
            f"--socket={root}/munge/socket",
            f"--key-file={key}",
            f"--pid-file={root}/munge/pid",
            f"--log-file={root}/log/munged.log",
            f"--seed-file={root}/munge/seed",
        ],
        cluster.env,
        "munged",
    )
    _start([_which("slurmctld"), "-i"], cluster.env, "slurmctld")  # -i: ignore old state
    _start([_which("slurmd")], cluster.env, "slurmd")
    deadline = time.monotonic() + idle_timeout
    while (state := cluster.command("sinfo", "-h", "-o", "%T").stdout.strip()) != "idle":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the node is {state or 'unknown'}, not idle, after {idle_timeout} s\n{cluster.logs()}")
        time.sleep(0.2)
