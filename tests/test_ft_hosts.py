"""Per-step fault tolerance across real hosts: a machine is lost and the others never stop.

Three network-namespace hosts (netns.py), one replica group each, run the same
`torchfleet train --fault-tolerance step --nnodes 3 --node-rank i --master-addr <host 0>`;
host 0's launcher runs torchft's lighthouse. Host 2 stalls after a known step and every process
on it gets SIGKILL (a machine that dies). The two others must go on at once: no restart, no
checkpoint read, a step counter that never goes back, a pause that is measured and said. Host 2
is started again with the same command, heals from a live peer (torchft's transport), and trains
to the end; then the three groups' weights are identical and the validation accuracy is within a
point of an uninterrupted run's.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import clean_env, torchfleet
from netns import hosts

pytest.importorskip("torchft", reason="--fault-tolerance step needs torchft (the dev extra installs it)")

LOST, LOST_AFTER = 2, 20  # host 2 stalls after step 20 and is then lost
PORT = 29510  # inside the namespaces: no other job can hold it
JOB = ["train", "--model", "mlp", "--data", "digits", "--batch-size", "48", "--no-progress", "--hang-timeout", "0",
       "--log-every", "1"]
# (strategy, processes per group, epochs): long enough that host 2 is back before the others end. Its
# start (the interpreter, torch, the model, on cores the survivors keep busy) took 5 s with one process
# per group and 20 s with two, while the survivors trained on at 10 to 15 steps a second.
CASES = {
    "ddp-1-per-group": ("ddp", 1, 24),
    "fsdp-2-per-group": ("fsdp", 2, 40),
}


def _wait_for(what: str, ready, net, procs: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        ended = [i for i, p in procs.items() if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            for i in range(len(net.names)):
                net.lose(i)
            outputs = "".join(f"\n--- host {i}:\n{p.communicate(timeout=30)[0]}" for i, p in procs.items())
            pytest.fail(f"waiting for {what}: hosts {ended} ended, or {timeout:.0f} s passed{outputs}")
        time.sleep(0.2)


def _listening(net, i: int) -> set[str]:
    """The local addresses of every listening TCP socket in host i."""
    out = net.run(i, ["ss", "-Hltn"], timeout=10).stdout
    return {line.split()[3].rsplit(":", 1)[0].strip("[]") for line in out.splitlines() if line.strip()}


def _steps(path) -> list[int]:
    return [int(r["step"]) for r in csv.DictReader(path.open()) if r["kind"] == "train"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy,nproc,epochs", CASES.values(), ids=CASES.keys())
def test_a_lost_host_leaves_the_others_training_and_heals_when_it_comes_back(strategy, nproc, epochs, tmp_path):
    fired, ckpt = tmp_path / "fired", tmp_path / "ckpt"
    job = [*JOB, "--strategy", strategy, "--epochs", str(epochs)]

    def command(i: int, run: str) -> list[str]:
        return [sys.executable, "-m", "torchfleet", *job, "--fault-tolerance", "step", "--nnodes", "3",
                "--node-rank", str(i), "--master-addr", net.addr(0), "--master-port", str(PORT), "-n", str(nproc),
                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "50",
                "--json-out", str(tmp_path / f"{run}.json"), "--metrics-out", str(tmp_path / f"{run}.csv"),
                "--save-model", str(tmp_path / f"{run}.pt")]

    with hosts(3) as net:
        def start(i: int, run: str, **env) -> subprocess.Popen:
            return net.popen(i, command(i, run), env=clean_env(**env), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)

        procs = {0: start(0, "host0")}
        procs |= {1: start(1, "host1"),
                  LOST: start(LOST, "lost", TORCHFLEET_FAULT=f"sleep:rank=0:step={LOST_AFTER}:once={fired}")}
        _wait_for(f"host {LOST} to stall after step {LOST_AFTER}", fired.exists, net, procs, 150)
        listening = {i: _listening(net, i) for i in range(3)}
        net.lose(LOST)
        lost_output = procs[LOST].communicate(timeout=30)[0]
        procs[LOST] = start(LOST, "host2")  # the machine is back: the same command
        outputs = {i: procs[i].communicate(timeout=300)[0] for i in range(3)}
        codes = {i: procs[i].returncode for i in range(3)}
    if codes[LOST] and codes[0] == codes[1] == 0 and "lighthouse at" in outputs[LOST]:
        pytest.fail(f"host {LOST} came back after the others had finished, too late to heal (its start took"
                    f" longer than their remaining steps on this machine): {outputs[LOST][-600:]}")
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, outputs, lost_output)
    # The uninterrupted reference, afterwards (its cores were the hosts'): serial on this machine. An
    # uninterrupted job of replica groups trains serial's weights (test_ft.py checks it to 1e-5).
    reference = torchfleet(*job, "--strategy", "serial", "--json-out", str(tmp_path / "serial.json"), timeout=300)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    # Exposure: the lighthouse (host 0), torchft's manager server, its store and Gloo listen on the host's
    # own address, the agent's stores on loopback; nothing on every address (0.0.0.0, [::], *).
    for i, found in listening.items():
        assert found and found <= {net.addr(i), "127.0.0.1"}, (i, found)

    # The survivors: one account of the loss each, with the pause it cost; no restart, no reload.
    pauses = []
    for i in (0, 1):
        text = outputs[i]
        found = re.search(rf"group {LOST} left at step (\d+): groups 0, 1 went on after a pause of ([\d.]+) s", text)
        assert found, text
        assert int(found.group(1)) >= LOST_AFTER
        pauses.append(float(found.group(2)))
        assert f"group {LOST} joined at step" in text, text
        assert "resumed from" not in text and "restart" not in text.lower(), text
        steps = _steps(tmp_path / f"host{i}.csv")
        assert steps == sorted(steps) and steps[-1] == epochs * 29, steps[-5:]  # never goes back
    print(f"{strategy}: the survivors paused {pauses} s when host {LOST} was lost")
    # The host that came back healed from a live peer and trained to the end.
    healed = re.search(r"group 2 healed from group ([01]) at step (\d+)", outputs[LOST])
    assert healed, outputs[LOST]
    assert int(healed.group(2)) > LOST_AFTER
    assert "waits for the other groups" not in outputs[LOST]
    summaries = [json.loads((tmp_path / f"host{i}.json").read_text()) for i in range(3)]
    assert [s["steps"] for s in summaries] == [epochs * 29] * 3
    weights = [torch.load(tmp_path / f"host{i}.pt", weights_only=True) for i in range(3)]
    for i in (1, 2):
        assert all(torch.equal(weights[i][k], weights[0][k]) for k in weights[0]), f"host {i} differs from host 0"
    serial = json.loads((tmp_path / "serial.json").read_text())
    accuracy = summaries[0]["val_accuracy"]
    print(f"{strategy}: validation accuracy {accuracy:.4f}, uninterrupted {serial['val_accuracy']:.4f};"
          f" host 2 healed at step {healed.group(2)} from group {healed.group(1)}")
    assert abs(accuracy - serial["val_accuracy"]) <= 0.01
    assert {s["val_accuracy"] for s in summaries} == {accuracy}
    # Periodic checkpoints went on, written by one group (the first in each quorum).
    assert (ckpt / f"step-{epochs * 29:08d}").is_dir()


@pytest.mark.timeout(120)
def test_an_unreachable_lighthouse_is_one_sentence_and_status_2_within_30_s(tmp_path):
    with hosts(2) as net:
        start = time.monotonic()
        out = net.run(1, [sys.executable, "-m", "torchfleet", *JOB, "--strategy", "ddp", "--fault-tolerance", "step",
                          "--nnodes", "2", "--node-rank", "1", "--master-addr", net.addr(0), "--master-port",
                          str(PORT), "-n", "1"], env=clean_env(), timeout=90)
        seconds = time.monotonic() - start
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot reach the lighthouse at {net.addr(0)}:{PORT} within 25 s" in out.stderr
    print(f"refused after {seconds:.1f} s")
    assert seconds < 30  # 25 s of knocking, and the interpreter's start


def test_a_lighthouse_given_an_address_of_another_machine_is_refused(tmp_path):
    out = torchfleet("lighthouse", "--host", "192.0.2.1", "--port", "29599")
    assert out.returncode == 2 and "not an address of this machine" in out.stderr, out.stderr


@pytest.mark.timeout(300)
def test_a_lost_diloco_host_leaves_the_other_training_and_heals_at_a_meeting(tmp_path):
    """diloco across two hosts, meetings every 10 steps: host 1 stalls after step 20 and is lost. Host 0 goes on
    alone at its next meeting, never restarts or reloads, and its steps never go back; host 1, started again,
    meets host 0 at one of its meetings, heals from it, and both end with the same weights."""
    fired, epochs, every = tmp_path / "fired", 40, 10
    job = [*JOB, "--strategy", "diloco", "--sync-every", str(every), "--epochs", str(epochs)]

    with hosts(2) as net:
        def start(i: int, run: str, **env) -> subprocess.Popen:
            command = [sys.executable, "-m", "torchfleet", *job, "--nnodes", "2", "--node-rank", str(i),
                       "--master-addr", net.addr(0), "--master-port", str(PORT), "-n", "1",
                       "--json-out", str(tmp_path / f"{run}.json"), "--metrics-out", str(tmp_path / f"{run}.csv"),
                       "--save-model", str(tmp_path / f"{run}.pt")]
            return net.popen(i, command, env=clean_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)

        procs = {0: start(0, "host0"), 1: start(1, "lost", TORCHFLEET_FAULT=f"sleep:rank=0:step=20:once={fired}")}
        _wait_for("host 1 to stall after step 20", fired.exists, net, procs, 150)
        net.lose(1)
        procs[1].communicate(timeout=30)
        procs[1] = start(1, "host1")
        outputs = {i: procs[i].communicate(timeout=240)[0] for i in range(2)}
        codes = {i: procs[i].returncode for i in range(2)}
    assert codes == {0: 0, 1: 0}, (codes, outputs)
    left = re.search(r"group 1 left at step (\d+): group 0 went on after a pause of ([\d.]+) s", outputs[0])
    assert left and int(left.group(1)) % every == 0 and int(left.group(1)) >= 20, outputs[0]
    joined = re.search(r"group 1 joined at step (\d+) and healed from this group \(0\)", outputs[0])
    assert joined and int(joined.group(1)) % every == 0, outputs[0]
    assert "resumed from" not in outputs[0] and "restart" not in outputs[0].lower(), outputs[0]
    healed = re.search(r"group 1 healed from group 0 at step (\d+)", outputs[1])
    assert healed and int(healed.group(1)) == int(joined.group(1)), outputs[1]
    steps = _steps(tmp_path / "host0.csv")
    assert steps == sorted(steps) and steps[-1] == epochs * 29, steps[-5:]  # never goes back
    assert _steps(tmp_path / "host1.csv")[0] > int(healed.group(1))  # the healed host starts at the meeting
    weights = [torch.load(tmp_path / f"host{i}.pt", weights_only=True) for i in range(2)]
    assert all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0]), "host 1 differs from host 0"
    print(f"diloco: host 0 paused {left.group(2)} s at step {left.group(1)}; host 1 healed at step"
          f" {healed.group(1)} and both ended alike")
