"""Elastic membership for real: three hosts, one is lost, the job finishes on two.

Three network-namespace hosts (netns.py) run one `torchfleet run --nnodes 2:3`
each, torchrun's c10d rendezvous at host 0 (or 1). After the checkpoint at
step 4, one host is lost: every process on it (agent and worker) gets SIGKILL.
The survivors' workers fail in their next all-reduce, their agents restart them
(--max-restarts), the rendezvous completes again with 2 nodes, and the trainer
resumes from the step-4 checkpoint and finishes. Its weights must equal a run
that was never interrupted. The rendezvous ranks the machines by address, so
host i is node rank i: losing host 2 loses the last rank, losing host 0 (with
the rendezvous store on host 1) loses rank 0, whose machine held the workers'
store and is the main rank's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from helpers import clean_env, newest_checkpoint_model, said
from netns import hosts

STEPS, EVERY, LOST_AFTER = 10, 4, 5  # checkpoints at 4, 8, 10; host 2 stops after step 5
PORT = 29410  # inside the namespaces: no other job can hold it
# 48 splits among 3 processes and among 2: the global batch is what each step takes,
# whatever the number of processes (README, "--batch-size is the global batch").
JOB = [
    "train",
    "--strategy",
    "ddp",
    "--model",
    "mlp",
    "--data",
    "digits",
    "--epochs",
    "1",
    "--max-steps",
    str(STEPS),
    "--batch-size",
    "48",
    "--no-progress",
    "--hang-timeout",
    "0",
]
# torch's c10d defaults would add about 45 s: a lost node is declared dead after 3 missed
# heartbeats 5 s apart, and a rendezvous that has its minimum waits 30 s more for latecomers.
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60"


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([t.flatten() for t in state.values()])


def _manifest(directory, step: int) -> dict:
    return json.loads((directory / f"step-{step:08d}" / "manifest.json").read_text())


def _listening(net, i: int, port: int) -> bool:
    ss = net.run(i, ["ss", "-Hltn", f"sport = :{port}"], timeout=10)
    return bool(ss.stdout.strip())


def _wait_for(what: str, ready, net, procs: dict, timeout: float) -> None:
    """Poll `ready()` until true; fail at once if a host's command ended, or after `timeout`."""
    deadline = time.monotonic() + timeout
    while not ready():
        ended = [i for i, p in procs.items() if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            for i in range(len(net.names)):
                net.lose(i)  # the workers too, which hold the output pipes open
            outputs = "".join(f"\n--- host {i}:\n{p.communicate(timeout=30)[0]}" for i, p in procs.items())
            pytest.fail(f"waiting for {what}: hosts {ended} ended, or {timeout:.0f} s passed{outputs}")
        time.sleep(0.2)


# (lost host, rendezvous host): the store's host cannot be lost (it holds the rendezvous).
LOSSES = {
    # CI's floor lane loses the store's host alone: the rendezvous that outlives its store is the case a torch
    # release can break; losing another host takes the same agent calls.
    "node-2-of-3": pytest.param(2, 0, marks=pytest.mark.newest_lane),
    "node-0-of-3": pytest.param(0, 1),
}


@pytest.mark.timeout(600)  # about 30 s alone; each wait below is sized for CI's parts side by side
@pytest.mark.parametrize("lost,store", LOSSES.values(), ids=LOSSES.keys())
def test_a_host_of_three_is_lost_and_two_finish_with_the_uninterrupted_weights(lost, store, tmp_path):
    start = time.monotonic()
    ckpt, fired = tmp_path / "ckpt", tmp_path / "fired"
    survivors = [i for i in range(3) if i != lost]
    main = survivors[0]  # the lowest address left: rank 0 after the loss, which prints and writes
    # The lost host sleeps after step 5 (the checkpoint of step 4 is complete by then) and writes
    # `fired` first, so the loss lands at a known step however slow this machine is.
    stall = f"sleep:rank={lost}:step={LOST_AFTER}:once={fired}"

    def command(i: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torchfleet",
            "run",
            "--nnodes",
            "2:3",
            "-n",
            "1",
            "--rdzv-endpoint",
            f"{net.addr(store)}:{PORT}",
            "--rdzv-conf",
            RDZV_CONF,
            "--max-restarts",
            "2",
            "-m",
            "torchfleet",
            *JOB,
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            str(EVERY),
            "--json-out",
            str(tmp_path / f"host{i}.json"),
        ]

    with hosts(3) as net:

        def start_host(i: int) -> subprocess.Popen:
            env = clean_env(**({"TORCHFLEET_FAULT": stall} if i == lost else {}))
            return net.popen(i, command(i), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        # The reference: 2 processes on this machine, never interrupted. It stands for an
        # uninterrupted two-host run because ddp's result does not depend on how many
        # processes or machines share the global batch (test_multinode.py checks 2 hosts
        # against 1 process; test_equivalence.py ddp against serial, within 1e-5). It runs
        # alongside the hosts, which spend seconds waiting on the rendezvous.
        reference = subprocess.Popen(
            [sys.executable, "-m", "torchfleet", *JOB, "-n", "2", "--checkpoint-dir", str(tmp_path / "reference")],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        net.procs.append(reference)  # killed with the hosts if the test fails first

        # The store's host first: the others' preflight knocks on its rendezvous port for the join wait
        # (60 s), and on a loaded machine that host may take longer than that to start torch.
        procs = {store: start_host(store)}
        _wait_for("the rendezvous store", lambda: _listening(net, store, PORT), net, procs, 180)
        procs |= {i: start_host(i) for i in range(3) if i != store}
        # Three hosts importing torch, meeting and training 5 steps: over 60 s under CI's load (30 Nov).
        _wait_for(f"host {lost} to stall after step 5", fired.exists, net, procs, 240)
        lost_at = time.monotonic()
        net.lose(lost)
        outputs = [procs[i].communicate(timeout=180)[0] for i in range(3)]
        codes = [procs[i].returncode for i in range(3)]
        finished = time.monotonic()
        reference_out = reference.communicate(timeout=120)[0]
    assert reference.returncode == 0, reference_out
    expected = _flat(newest_checkpoint_model(tmp_path / "reference")[1])
    print(f"three hosts until the loss {lost_at - start:.1f} s, two hosts after it {finished - lost_at:.1f} s")
    assert codes == [-9 if i == lost else 0 for i in range(3)], said(codes, dict(enumerate(outputs)))
    # The checkpoint the survivors resumed from was written by three processes, the
    # final one by two; the main rank (now the lowest address left) says where it resumed.
    assert _manifest(ckpt, EVERY)["world_size"] == 3
    assert _manifest(ckpt, STEPS)["world_size"] == 2
    assert f"resumed from {ckpt / f'step-{EVERY:08d}'} at step {EVERY}" in outputs[main], outputs[main]
    # Before the rendezvous no machine has a node rank: none may call itself "node 0".
    for i in survivors:
        assert f"preflight ok on this machine ({net.addr(i)}) via eth0" in outputs[i], outputs[i]
    summary = json.loads((tmp_path / f"host{main}.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (2, STEPS)
    name, state = newest_checkpoint_model(ckpt)
    assert name == f"step-{STEPS:08d}"
    diff = (_flat(state) - expected).abs().max().item()
    print(f"max weight difference from the uninterrupted run: {diff:.3g}")
    assert diff < 1e-5


def test_rdzv_conf_adds_to_the_rendezvous_options_torchfleet_chose():
    """--rdzv-conf once replaced them: the c10d host lost `is_host`, nobody hosted the store,
    and the test above timed out on every node; the static rendezvous took rank 0 everywhere."""
    from torchfleet.config import LaunchConfig
    from torchfleet.launcher import elastic_config, torchrun_flags

    given = torchrun_flags.agent_overrides({"rdzv_conf": "last_call_timeout=5"}, "x.py", [], one_machine=False)
    elastic = elastic_config.agent_config(LaunchConfig(nnodes="2:3", rdzv_endpoint="127.0.0.1:29400"), given)
    assert elastic.rdzv_configs["is_host"] is True and elastic.rdzv_configs["last_call_timeout"] == "5"
    assert "rank" not in elastic.rdzv_configs
    static = elastic_config.agent_config(LaunchConfig(nnodes=2, node_rank=1, master_addr="127.0.0.1"), given)
    assert (static.rdzv_configs["rank"], static.rdzv_configs["last_call_timeout"]) == (1, "5")


def test_an_elastic_machine_checks_the_endpoints_port_not_the_master_port():
    """Every elastic machine is node_rank 0 until the rendezvous, and each used to refuse to start
    when the master port (which an elastic job never opens) was taken on it."""
    import socket

    from torchfleet.config import LaunchConfig
    from torchfleet.errors import UsageError
    from torchfleet.launcher import ports

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The store is elsewhere (192.0.2.1, TEST-NET: never this machine); the taken port is only
        # --master-port, which the c10d rendezvous does not use.
        ports.check_ports(LaunchConfig(nnodes="2:3", rdzv_endpoint="192.0.2.1:29400", master_port=port))
        with pytest.raises(UsageError, match=f"--rdzv-endpoint 127.0.0.1:{port}: port {port} is already in use"):
            ports.check_ports(LaunchConfig(nnodes="2:3", rdzv_endpoint=f"127.0.0.1:{port}"))
