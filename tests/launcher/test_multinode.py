"""Many machines, on real separate network hosts (namespaces, see netns.py).

Each host has its own interfaces and addresses, and its host name resolves to
127.0.0.1: the set-up where Gloo, left alone, advertises loopback and the ranks
never meet. torchfleet must choose the interface, check the nodes first, and
give the same weights as one machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from helpers import clean_env, forked_torchfleet, newest_checkpoint_model, torchfleet
from netns import hosts
from torchfleet.launcher import preflight

JOB = [
    "train",
    "--strategy",
    "ddp",
    "--model",
    "mlp",
    "--epochs",
    "1",
    "--max-steps",
    "4",
    "--batch-size",
    "32",
    "--no-progress",
]


def _final_weights(directory) -> torch.Tensor:
    _, state = newest_checkpoint_model(directory)
    return torch.cat([t.flatten() for t in state.values()])


def _on_hosts(net, argv_for, env_for=None, timeout=420) -> list[tuple[int, str, float]]:
    """Start `torchfleet argv_for(i)` on every host at once; (status, output, seconds) each. The time allowed is
    CI's load's: beside ten busy processes the 2 x 2 elastic job took 113 s (preflight at 40 s, trained at 88 s),
    and under both CI lanes (30 Nov) it ran past 200 s; the whole test takes 42 s idle."""
    start = time.monotonic()
    procs = [
        net.popen(
            i,
            [sys.executable, "-m", "torchfleet", *argv_for(i)],
            env=(env_for or (lambda i: clean_env()))(i),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(len(net.names))
    ]
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
            results.append((proc.returncode, out, time.monotonic() - start))
    except subprocess.TimeoutExpired:
        # Every node's output, not only the one waited on: where a job stalls shows in the others' lines.
        for proc in procs:
            proc.kill()
        outputs = [proc.communicate()[0] for proc in procs]
        pytest.fail(
            f"the job ran past {timeout} s; each node's output:\n"
            + "\n".join(f"--- node {i}:\n{out}" for i, out in enumerate(outputs))
        )
    return results


@pytest.mark.timeout(1000)
def test_two_nodes_train_the_weights_of_one_machine(tmp_path):
    reference = torchfleet(*JOB, "--strategy", "serial", "--checkpoint-dir", str(tmp_path / "one"))
    assert reference.returncode == 0, reference.stderr
    expected = _final_weights(tmp_path / "one")
    with hosts(2) as net:
        # 2 nodes x 1 process, torchrun's static rendezvous at node 0.
        static = _on_hosts(
            net,
            lambda i: [
                *JOB,
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "-n",
                "1",
                "--master-addr",
                net.addr(0),
                "--master-port",
                "29401",
                "--checkpoint-dir",
                str(tmp_path / "static"),
            ],
        )
        # 2 nodes x 2 processes, the c10d rendezvous (torchrun's --rdzv-endpoint).
        elastic = _on_hosts(
            net,
            lambda i: [
                *JOB,
                "--nnodes",
                "2",
                "-n",
                "2",
                "--rdzv-endpoint",
                f"{net.addr(0)}:29402",
                "--checkpoint-dir",
                str(tmp_path / "elastic"),
                "--json-out",
                str(tmp_path / "elastic.json"),
            ],
        )
    for runs in (static, elastic):
        assert [status for status, _, _ in runs] == [0, 0], runs
    node1 = static[1][1]
    # The preflight ran on every node, chose the veth (not lo), and agreed on versions.
    assert "preflight ok on node 1 (10.77.0.2) via eth0" in node1 and "on all 2 nodes" in node1
    assert "Mbit/s" in node1
    for name in ("static", "elastic"):
        got = _final_weights(tmp_path / name)
        assert (got - expected).abs().max().item() < 1e-5, name
    assert json.loads((tmp_path / "elastic.json").read_text())["world_size"] == 4


def _doctor(master: str, port: int, node: int) -> list[str]:
    return ["doctor", "--master-addr", master, "--master-port", str(port), "--nnodes", "2", "--node-rank", str(node)]


def _one_error(status: int, out: str, seconds: float, join: float = preflight.JOIN_SECONDS) -> str:
    """The run failed the way a user should see it: status 2, one sentence, before any wait ran out.

    The preflight's longest wait is node 0's `join` (JOIN_SECONDS, 60 s, unless set), for a node that
    never reports. A fault found by its own check ends before that; one noticed only when a wait runs
    out ends after it. The bound is that wait, not a speed target: CI runs these hosts beside another
    torch lane, where the version check has taken 24 s at a load average of 6.
    """
    assert status == 2, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert seconds < join, (seconds, out)
    return errors[0]


# Both nodes of the version case start at once, and under CI's test parts side by side node 1 once took over 60 s
# to import torch and report (30 Nov): node 0 then named it missing. Machines that start minutes apart are what
# TORCHFLEET_PREFLIGHT_JOIN_SECONDS is for; this case waits 240 s for the report, and the check still ends in
# seconds once both have reported.
VERSION_CASE_JOIN = 240


@pytest.mark.waits
@pytest.mark.timeout(600)
def test_preflight_names_the_node_and_the_cause_in_seconds():
    with hosts(2) as net:
        errors = {}
        # Alone on host 1 (nothing runs on host 0): a master address where no host answers,
        # then the right address but a port nothing listens on, knocked on for the join wait (node 0 may still be
        # starting), here 5 s.
        for what, master, port in (("no host there", "10.77.0.9", 29403), ("closed port", net.addr(0), 29404)):
            start = time.monotonic()
            ran = net.run(
                1,
                [sys.executable, "-m", "torchfleet", *_doctor(master, port, 1)],
                env=clean_env(TORCHFLEET_PREFLIGHT_JOIN_SECONDS="5"),
                timeout=120,
            )
            errors[what] = _one_error(ran.returncode, ran.stdout + ran.stderr, time.monotonic() - start)
        shown = net.run(
            1, [sys.executable, "-m", "torchfleet", "doctor", "--master-addr", net.addr(0)], env=clean_env(), timeout=60
        )
        no_route = net.run(
            1,
            [
                sys.executable,
                "-c",
                "from torchfleet.launcher import preflight\n"
                "try: preflight.route(1, '192.0.2.1')\n"
                "except preflight.PreflightError as e: print(e)",
            ],
            env=clean_env(),
            timeout=60,
        )
        # A version mismatch, simulated on node 1, found by the preflight of `train` itself.
        mismatch = _on_hosts(
            net,
            lambda i: [
                *JOB,
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "-n",
                "1",
                "--master-addr",
                net.addr(0),
                "--master-port",
                "29406",
            ],
            env_for=lambda i: clean_env(
                TORCHFLEET_PREFLIGHT_JOIN_SECONDS=str(VERSION_CASE_JOIN),
                **({"TORCHFLEET_PREFLIGHT_TORCH_VERSION": "2.13.0"} if i else {}),
            ),
            timeout=VERSION_CASE_JOIN + 120,
        )
    assert (
        "node 1 (10.77.0.2): connection to the master 10.77.0.9:29403 timed out" in errors["no host there"]
        or "10.77.0.9:29403 failed: no route to host" in errors["no host there"]
    )
    assert "node 1 (10.77.0.2): connection to the master 10.77.0.1:29404 was refused" in errors["closed port"]
    assert errors["closed port"].endswith("after 5 s"), errors["closed port"]
    # doctor shows the choice: the veth that routes to the master, for Gloo and NCCL alike.
    assert shown.returncode == 0, shown.stderr
    assert "interface to the master 10.77.0.1: eth0 (this machine's address there: 10.77.0.2)" in shown.stdout
    assert "GLOO_SOCKET_IFNAME=eth0" in shown.stdout and "NCCL_SOCKET_IFNAME=eth0" in shown.stdout
    assert no_route.stdout.startswith("node 1: interface has no route to the master 192.0.2.1"), no_route
    for status, out, seconds in mismatch:  # both nodes stop, both name node 1 and the versions
        line = _one_error(status, out, seconds, VERSION_CASE_JOIN)
        assert "node 1 (10.77.0.2): torch version 2.13.0 vs " + torch.__version__ + " on node 0" in line


@pytest.mark.timeout(300)
def test_node_0_waits_as_long_as_the_join_variable_says_for_a_node_that_never_starts():
    with hosts(2) as net:  # node 1's host stays empty
        start = time.monotonic()
        ran = net.run(
            0,
            [sys.executable, "-m", "torchfleet", *_doctor(net.addr(0), 29407, 0)],
            env=clean_env(TORCHFLEET_PREFLIGHT_JOIN_SECONDS="5"),
            timeout=240,
        )
        seconds = time.monotonic() - start
    line = _one_error(ran.returncode, ran.stdout + ran.stderr, seconds, join=seconds + 1)
    assert "node 0 (10.77.0.1): node 1 did not report within 5 s; start it with --node-rank 1" in line, line
    # A value that is not a number of seconds is refused before anything waits: one sentence, status 2.
    for bad in ("soon", "0", "-3", "inf"):
        out = forked_torchfleet(*_doctor("127.0.0.1", 29408, 1), env=clean_env(TORCHFLEET_PREFLIGHT_JOIN_SECONDS=bad))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"TORCHFLEET_PREFLIGHT_JOIN_SECONDS={bad!r} is not a number of seconds above 0" in out.stderr


def _node_1_first(net, argv_for, env=None, timeout=240) -> tuple[subprocess.CompletedProcess, ...]:
    """Start `torchfleet argv_for(1)` on host 1, let it knock on node 0's closed port for longer than the 4 s an
    address that does not answer gets, then run node 0: (node 0's run, node 1's, its output in stdout)."""
    first = net.popen(
        1,
        [sys.executable, "-m", "torchfleet", *argv_for(1)],
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(preflight.CONNECT_SECONDS + 6)  # node 1 has started and knocked on a closed port meanwhile
    assert first.poll() is None, first.communicate()[0]
    second = net.run(0, [sys.executable, "-m", "torchfleet", *argv_for(0)], env=clean_env(), timeout=timeout)
    late = first.communicate(timeout=timeout)[0]
    return second, subprocess.CompletedProcess(first.args, first.returncode, late)


@pytest.mark.timeout(300)
def test_a_node_started_before_node_0_waits_for_it_and_both_pass_the_preflight():
    # A scheduler starts every machine at once, and node 0 may be the last to listen: node 1 knocks on a port that
    # refuses it for longer than the 4 s it gives an address that does not answer, and the two still meet.
    with hosts(2) as net:
        env = clean_env(TORCHFLEET_PREFLIGHT_JOIN_SECONDS="120")
        second, first = _node_1_first(net, lambda i: _doctor(net.addr(0), 29409, i), env, timeout=240)
    late = first.stdout
    assert second.returncode == 0 and first.returncode == 0, (second.stdout + second.stderr, late)
    assert "preflight ok on node 1 (10.77.0.2)" in late and "all 2 nodes" in late, late


@pytest.mark.timeout(400)
def test_an_elastic_node_started_before_the_rendezvous_host_waits_for_it(tmp_path):
    # The c10d rendezvous's host opens its store only once it has imported torch; a machine started first knocks
    # on the refused port for the join wait, not the 4 s an address that does not answer gets (CI, 1 Dec: node 1
    # gave up after 4 s and node 0 waited for it past 420 s).
    with hosts(2) as net:
        job = [*JOB, "--nnodes", "2", "-n", "1", "--rdzv-endpoint", f"{net.addr(0)}:29410", "--checkpoint-dir"]
        second, first = _node_1_first(net, lambda i: [*job, str(tmp_path / "ckpt")], timeout=300)
    late = first.stdout
    assert second.returncode == 0 and first.returncode == 0, (second.stdout + second.stderr, late)
    assert "connection to the master" not in late, late
