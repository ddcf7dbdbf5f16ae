"""Per-step fault tolerance (--fault-tolerance step) on one machine: replica groups are separate
`torchfleet train` commands (node ranks 0..n-1 at 127.0.0.1), torchft's lighthouse started by node 0,
real processes and sockets throughout. Losing and healing a group across real hosts is
test_ft_hosts.py's; here: an uninterrupted job of groups equals serial, checkpoints and resume,
the sentences a group says when it cannot go on, and the bad input refused before any process starts.
"""

from __future__ import annotations

import csv
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import ROOT, clean_env, read_outputs, require_module, said, torchfleet

require_module("torchft", "--fault-tolerance step needs torchft (the dev extra installs it)")

MLP = ["--model", "mlp", "--data", "digits", "--batch-size", "48", "--no-progress", "--hang-timeout", "0"]
SGD = ["--optimizer", "sgd", "--lr", "0.05"]  # replay()'s


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _groups(
    n: int, argv: list[str], tmp: Path, nproc: int = 1, port: int | None = None, timeout: float = 240, env=None
) -> list[tuple[int, str]]:
    """`torchfleet train --fault-tolerance step` as n groups on this machine; (status, output) each."""
    port = port or _free_port()
    procs = []
    for rank in range(n):
        command = [
            sys.executable,
            "-m",
            "torchfleet",
            "train",
            *argv,
            "--fault-tolerance",
            "step",
            "--nnodes",
            str(n),
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-n",
            str(nproc),
            "--save-model",
            str(tmp / f"group{rank}.pt"),
            "--json-out",
            str(tmp / f"group{rank}.json"),
            "--metrics-out",
            str(tmp / f"group{rank}.csv"),
        ]
        procs.append(
            subprocess.Popen(
                command, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
            )
        )
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            p.kill()


def _serial(argv: list[str], tmp: Path) -> dict:
    out = torchfleet(
        "train",
        *argv,
        "--strategy",
        "serial",
        "--save-model",
        str(tmp / "serial.pt"),
        "--json-out",
        str(tmp / "serial.json"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return torch.load(tmp / "serial.pt", weights_only=True)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


HEALED = "group 1 healed from group 0"


def one_group_killed(argv: list[str], step: int, tmp: Path) -> list[str]:
    """Two groups on this machine, each under its own agent with --max-restarts 1; group 1's worker is killed
    once after `step`. Both must end with status 0; their outputs, each group's weights, summary and metrics
    (group{g}.pt, .json, .csv) in tmp.

    From `step` on, group 0 sleeps 0.2 s after each step until group 1 says it healed: group 1's start again
    (its interpreter, torch, the model) took 5 s on a quiet machine and over 30 s at a load average of 5, and
    a group 0 that finished first closed the lighthouse on it. Paced, group 0 still steps, and commits alone,
    while it waits."""
    fired, healed, port = tmp / "fired", tmp / "healed", _free_port()

    def group(rank: int, **env) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchfleet",
                "train",
                *argv,
                "--fault-tolerance",
                "step",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-n",
                "1",
                "--max-restarts",
                "1",
                "--save-model",
                str(tmp / f"group{rank}.pt"),
                "--json-out",
                str(tmp / f"group{rank}.json"),
                "--metrics-out",
                str(tmp / f"group{rank}.csv"),
            ],
            env=clean_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )

    procs = [
        group(0, TORCHFLEET_FAULT=f"pace:rank=0:step={step}:seconds=0.2:until={healed}"),
        group(1, TORCHFLEET_FAULT=f"kill:rank=0:step={step}:once={fired}"),
    ]
    outputs = read_outputs(procs, timeout=240, when={1: (HEALED, healed.touch)})
    assert [p.returncode for p in procs] == [0, 0], said([p.returncode for p in procs], dict(enumerate(outputs)))
    assert fired.exists()
    return outputs


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy,groups,nproc",
    [pytest.param("ddp", 3, 1, marks=pytest.mark.slow), ("fsdp", 2, 2), ("pipeline", 2, 2)],  # 3 groups: test_ft_hosts
    ids=["ddp-3x1", "fsdp-2x2", "pipeline-2x2"],
)
def test_an_uninterrupted_job_of_replica_groups_trains_serials_weights(strategy, groups, nproc, tmp_path):
    argv = [*MLP, "--strategy", strategy, "--epochs", "1", "--max-steps", "12", "--log-every", "1"]
    runs = _groups(groups, argv, tmp_path, nproc=nproc)
    for status, output in runs:
        assert status == 0, output
        assert "setSequenceNumberForGroup" not in output, output  # torchft's call of a deprecated no-op
    expected = _serial([*MLP, "--epochs", "1", "--max-steps", "12"], tmp_path)
    weights = [torch.load(tmp_path / f"group{g}.pt", weights_only=True) for g in range(groups)]
    for g, state in enumerate(weights):
        # Every group's weights are bit for bit the others' (each steps the same averaged gradient).
        assert all(torch.equal(state[k], weights[0][k]) for k in state), f"group {g} differs from group 0"
    diff = _max_diff(weights[0], expected)
    print(f"{strategy} {groups} groups x {nproc}: max |weight - serial's| = {diff:.3g}")
    assert diff < 1e-5
    summaries = [json.loads((tmp_path / f"group{g}.json").read_text()) for g in range(groups)]
    assert [(s["replica_group"], s["replica_groups"], s["steps"]) for s in summaries] == [
        (g, groups, 12) for g in range(groups)
    ]
    serial = json.loads((tmp_path / "serial.json").read_text())
    assert {s["val_accuracy"] for s in summaries} == {serial["val_accuracy"]}
    # The mean of the groups' final losses (each over its share of the last batch) is serial's.
    assert sum(s["final_loss"] for s in summaries) / groups == pytest.approx(serial["final_loss"], rel=1e-5)
    # --metrics-out: the groups in each step's quorum, a row per step with --log-every 1.
    for g in range(groups):
        rows = [r for r in csv.DictReader((tmp_path / f"group{g}.csv").open()) if r["kind"] == "train"]
        assert [int(r["step"]) for r in rows] == list(range(1, 13))
        assert {r["participants"] for r in rows} == {str(groups)}


@pytest.mark.timeout(300)
def test_one_group_writes_the_checkpoints_and_every_group_resumes_from_them(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [*MLP, "--strategy", "ddp", "--epochs", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    first = _groups(2, [*argv, "--max-steps", "6"], tmp_path)
    assert [s for s, _ in first] == [0, 0], first
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000003", "step-00000006"]
    ranks = torch.load(ckpt / "step-00000006" / "ranks.pt", weights_only=True)
    assert ranks[0]["extra"]["replicas"] == {"step": 6, "batches_committed": 12}  # torchft's own count
    second = _groups(2, [*argv, "--max-steps", "12", "--resume"], tmp_path)
    assert [s for s, _ in second] == [0, 0], second
    assert "resumed from" in second[0][1] + second[1][1]
    expected = _serial([*MLP, "--epochs", "1", "--max-steps", "12"], tmp_path)
    for g in range(2):
        assert _max_diff(torch.load(tmp_path / f"group{g}.pt", weights_only=True), expected) < 1e-5


def replay(participants: dict[int, int], steps: int, groups: int = 2) -> dict:
    """The weights of `steps` SGD steps of MLP's job (lr 0.05, global batch 48, digits) in this process, step k
    on the first participants[k] of the `groups` shares of global batch k (the lost group being the last):
    what a job of replica groups must train, whichever of its steps a lost group missed."""
    from torchfleet.data import GlobalBatchSampler
    from torchfleet.train.datasets import digits
    from torchfleet.train.models import build_model, build_optimizer

    torch.manual_seed(0)  # as the training loop seeds its model
    data = digits("train", seed=0)
    model = build_model("mlp", (1, 8, 8), 10)
    optimizer = build_optimizer("sgd", model.parameters(), 0.05)
    sampler = GlobalBatchSampler(len(data), 48, seed=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    step = 0
    while step < steps:
        for batch in sampler:
            step += 1
            rows = torch.tensor(batch[: len(batch) * participants[step] // groups])
            optimizer.zero_grad()
            loss_fn(model(data.tensors[0][rows]), data.tensors[1][rows]).backward()
            optimizer.step()
            if step == steps:
                break
    return model.state_dict()


def _train_rows(path: Path) -> list[dict]:
    return [r for r in csv.DictReader(path.open()) if r["kind"] == "train"]


@pytest.mark.timeout(300)
def test_a_group_whose_worker_dies_is_restarted_by_its_agent_and_heals_from_a_live_peer(tmp_path):
    """Group 1's worker is killed after step 8; its own agent (--max-restarts 1) starts it again, it heals
    from group 0 instead of reading a checkpoint, and both end with the same weights.

    Those weights are also what the job must have trained: replayed here step by step, each step on the
    global batch of its number, whole where both groups took part (group 0's metrics say which) and half
    where group 0 went on alone. They differ when the step that group 1's death broke is not done again on
    the same batch, or when group 1, healed, reads another batch than its peer's."""
    steps = 2 * 29
    argv = [*MLP, *SGD, "--strategy", "ddp", "--epochs", "2", "--log-every", "1"]
    outputs = one_group_killed(argv, 8, tmp_path)
    healed = re.search(r"group 1 healed from group 0 at step (\d+)", outputs[1])
    assert healed and int(healed.group(1)) >= 8, outputs[1]
    # Its agent started it again within the 3 s the lighthouse waits for heartbeats, or after them.
    assert re.search(
        r"group 1 was lost and started again at step \d+, healing from this group \(0\); groups 0, 1"
        r" went on after a pause of|group 1 left at step \d+: group 0 went on",
        outputs[0],
    ), outputs[0]
    assert "resumed from" not in outputs[1]
    weights = [torch.load(tmp_path / f"group{g}.pt", weights_only=True) for g in range(2)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    summaries = [json.loads((tmp_path / f"group{g}.json").read_text()) for g in range(2)]
    assert [s["steps"] for s in summaries] == [steps] * 2
    assert summaries[0]["val_accuracy"] == summaries[1]["val_accuracy"]
    # Group 0 committed every step once, in order; some alone while group 1 was away.
    rows = _train_rows(tmp_path / "group0.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    participants = {int(r["step"]): int(r["participants"]) for r in rows}
    alone = sorted(s for s, n in participants.items() if n == 1)  # none when group 1 was back within 3 s
    assert set(participants.values()) <= {1, 2} and all(s > 8 for s in alone), participants
    # Group 1, started again, logged only steps after it healed, each once, to the end.
    after = [int(r["step"]) for r in _train_rows(tmp_path / "group1.csv")]
    assert after and after[0] > int(healed.group(1)) and after == list(range(after[0], steps + 1)), after
    diff = _max_diff(weights[0], replay(participants, steps))
    print(
        f"group 0 went on alone for {len(alone)} steps; group 1 healed at step {healed.group(1)};"
        f" max |weight - replay| = {diff:.3g}"
    )
    assert diff < 1e-5


@pytest.mark.waits
@pytest.mark.timeout(120)
def test_a_group_with_no_live_peer_says_so_and_stops(tmp_path):
    """torchfleet lighthouse runs alone; group 1 of 2 starts, no other group ever comes: after
    --join-timeout it stops with one sentence instead of training alone from its initial weights."""
    port = _free_port()
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "torchfleet", "lighthouse", "--host", "127.0.0.1", "--port", str(port)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        start = time.monotonic()
        out = torchfleet(
            "train",
            *MLP,
            "--strategy",
            "ddp",
            "--epochs",
            "1",
            "--fault-tolerance",
            "step",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--lighthouse",
            f"127.0.0.1:{port}",
            "--join-timeout",
            "4",
            "-n",
            "1",
            timeout=90,
        )
        seconds = time.monotonic() - start
    finally:
        lighthouse.terminate()
        said = lighthouse.communicate(timeout=30)[0]
    assert lighthouse.returncode == 0, said
    assert f"lighthouse listening on http://127.0.0.1:{port}" in said
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "replica group 1 waited" in text and "only group 1 of 2 joined: no live peer is ahead to heal from" in text
    assert "group 1 waits for the other groups at step 0 (group 1 here of 2)" in text
    assert seconds < 60


@pytest.mark.waits
@pytest.mark.timeout(240)  # its own waits: 90 s for the groups to start, 90 s for them to stop, and the asserts
def test_groups_whose_lighthouse_is_lost_stop_with_one_sentence(tmp_path):
    """The lighthouse (torchfleet lighthouse, apart) is killed while two groups train: each stops at its next
    step saying so, instead of a traceback from torchft's quorum after the timeout."""
    port = _free_port()
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "torchfleet", "lighthouse", "--host", "127.0.0.1", "--port", str(port)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchfleet",
                "train",
                *MLP,
                "--strategy",
                "ddp",
                "--epochs",
                "50",
                "--fault-tolerance",
                "step",
                "--nnodes",
                "2",
                "--node-rank",
                str(g),
                "--master-addr",
                "127.0.0.1",
                "--lighthouse",
                f"127.0.0.1:{port}",
                "--join-timeout",
                "20",
                "-n",
                "1",
                "--log-every",
                "1",
                "--metrics-out",
                str(tmp_path / f"group{g}.csv"),
            ],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for g in range(2)
    ]
    try:
        deadline = time.monotonic() + 90
        metrics = tmp_path / "group0.csv"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > 10):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the groups did not start"
            time.sleep(0.2)
        lighthouse.kill()
        start = time.monotonic()
        outputs = [p.communicate(timeout=90)[0] for p in procs]
        seconds = time.monotonic() - start
    finally:
        for p in [lighthouse, *procs]:
            p.kill()
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 1, text
        assert re.search(
            r"replica group [01] got no quorum at step \d+ \(.*\): the lighthouse at"
            rf" http://127.0.0.1:{port} does not answer",
            text,
        ), text
    print(f"both groups stopped {seconds:.1f} s after the lighthouse was lost")
    assert seconds < 60


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seeds", ["same", "by-group"])
def test_a_script_runs_as_replica_groups_unless_they_start_from_different_weights(seeds, tmp_path):
    """torchfleet run --fault-tolerance step with a Fleet script; seeded differently per group, the groups
    would step apart forever, and Fleet stops them."""
    port = _free_port()
    script = [str(ROOT / "tests" / "scripts" / "ft_seeds.py"), *(["--seed-by-group"] if seeds == "by-group" else [])]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchfleet",
                "run",
                "--fault-tolerance",
                "step",
                "--nnodes",
                "2",
                "--node-rank",
                str(g),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-n",
                "1",
                *script,
            ],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for g in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        if seeds == "same":
            assert p.returncode == 0, text
            assert "replica group" in text and "different weights" not in text
        else:
            assert p.returncode == 1, text
            assert "the replica groups start from different weights" in text, text


def test_the_account_names_who_left_who_joined_and_the_pause():
    from torchfleet.replica_groups.quorum_log import Account

    account = Account(group=0, groups=3)
    transport = SimpleNamespace(received=None, sent=[])
    account.members = (0, 1, 2)
    assert account.committed(1, (0, 1, 2), transport) == []
    for step in range(2, 6):
        time.sleep(0.01)
        assert account.committed(step, (0, 1, 2), transport) == []
    time.sleep(0.3)  # the survivors wait for the lost group's heartbeats to stop
    lines = account.committed(6, (0, 1), transport)
    assert len(lines) == 1 and lines[0].startswith("group 2 left at step 5: groups 0, 1 went on after a pause of 0.")
    assert 0.25 < account.pauses[0] < 0.6
    transport.sent = [([2], 9)]  # this group sent its state to replica rank 2 (group 2) at step 9
    assert account.committed(10, (0, 1, 2), transport) == [
        "group 2 joined at step 9 and healed from this group (0) (3 of 3 groups)"
    ]
    assert account.committed(15, (0, 1, 2), transport, quorum_id=7) == []  # the first quorum id seen
    time.sleep(0.2)
    transport.sent = [([1], 15)]  # group 1 died and came back before the lighthouse gave up on it
    lines = account.committed(16, (0, 1, 2), transport, quorum_id=8)
    assert lines[0].startswith(
        "group 1 was lost and started again at step 15, healing from this group (0); groups"
        " 0, 1, 2 went on after a pause of"
    ), lines
    healing = Account(group=2, groups=3)
    received = SimpleNamespace(received=(1, 9, 0.25), sent=[])
    assert healing.committed(10, (0, 1, 2), received) == [
        "group 2 healed from group 1 at step 9: took its weights in 0.2 s, and goes on with groups 0, 1, 2"
    ]


def test_a_quorum_is_recorded_as_the_groups_torchft_names():
    from torchfleet.replica_groups.quorum_log import recording

    class Base:
        def __init__(self, timeout=None):
            self.configured = None

        def configure(
            self,
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id=None,
            group_rank=None,
            group_world_size=None,
            global_ranks=None,
        ):
            self.configured = (store_addr, rank, world_size)

    pg = recording(Base)()
    # group rank 1 of groups of 2 processes: groups 0, 2 and 5 make this quorum (torchft's global ranks)
    pg.configure("h:1/torchft/3/1", "group2", 1, 3, 3, 1, 2, [1, 5, 11])
    assert pg.members == (0, 2, 5) and pg.configured == ("h:1/torchft/3/1", 1, 3)


def test_a_replica_groups_state_refuses_another_layout():
    from torchfleet.errors import TrainingError
    from torchfleet.replica_groups.healing_state import TrainingState

    torch.manual_seed(0)
    small, large = torch.nn.Linear(4, 2), torch.nn.Linear(4, 3)
    mine = TrainingState(small, torch.optim.AdamW(small.parameters()))
    theirs = TrainingState(large, torch.optim.AdamW(large.parameters()))
    with pytest.raises(TrainingError, match=r"layouts differ \(weight\(2, 4\) here, weight\(3, 4\) there\)"):
        mine.load(theirs.state(), "group 1")


def test_a_healing_group_takes_weights_and_optimizer_state_in_place():
    from torchfleet.replica_groups.healing_state import TrainingState

    torch.manual_seed(0)
    live, fresh = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    live_opt, fresh_opt = torch.optim.AdamW(live.parameters(), lr=0.1), torch.optim.AdamW(fresh.parameters())
    live(torch.randn(5, 4)).sum().backward()
    live_opt.step()
    weight = fresh.weight  # the same Parameter object must hold the new values (the optimizer steps it)
    TrainingState(fresh, fresh_opt).load(TrainingState(live, live_opt).state())
    assert fresh.weight is weight and torch.equal(fresh.weight, live.weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    for a, b in zip(live.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(live_opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"])
        assert fresh_opt.state[b]["step"].device.type == "cpu" and fresh_opt.state[b]["step"].item() == 1


BAD = {
    "unknown mode": (["--fault-tolerance", "always"], "--fault-tolerance 'always' is not a mode; choose restart"),
    "elastic": (["--fault-tolerance", "step", "--nnodes", "2:3"], "--fault-tolerance step takes a fixed --nnodes"),
    "lighthouse without step": (
        ["--lighthouse", "10.0.0.1:29510"],
        "--lighthouse 10.0.0.1:29510 applies with --fault-tolerance step",
    ),
    "bad lighthouse": (
        ["--fault-tolerance", "step", "--lighthouse", "10.0.0.1:http"],
        "--lighthouse '10.0.0.1:http' is not HOST:PORT",
    ),
    "join timeout": (["--fault-tolerance", "step", "--join-timeout", "0"], "--join-timeout 0.0 must be a positive"),
    "hogwild": (
        ["--fault-tolerance", "step", "--strategy", "hogwild", "-n", "2"],
        "hogwild shares memory inside one machine and has no gradients to average across replica groups",
    ),
}


def refused_in_one_sentence(flags: list[str], capsys) -> str:
    """`torchfleet train` with these flags: status 2 and one line on stderr, no traceback; the line."""
    from torchfleet.cli import main

    assert main(["train", *MLP, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def outside_replica_groups(monkeypatch) -> None:
    from torchfleet.env import replicas

    for name in (replicas.GROUP, replicas.GROUPS, replicas.LIGHTHOUSE, replicas.ADDR):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("flags,sentence", BAD.values(), ids=BAD.keys())
def test_bad_fault_tolerance_input_is_one_sentence_and_status_2(flags, sentence, capsys):
    assert sentence in refused_in_one_sentence(flags, capsys)


def test_without_torchft_step_is_refused_saying_what_to_install(monkeypatch, capsys):
    from torchfleet.cli import main
    from torchfleet.replica_groups import torchft_setup

    monkeypatch.setattr(torchft_setup, "version", lambda: None)
    assert main(["train", *MLP, "--fault-tolerance", "step", "--nnodes", "2", "--master-addr", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert "--fault-tolerance step cannot run here: torchft is not installed; pip install 'torchfleet[ft]'" in err


def test_a_fleet_asked_for_a_mode_its_launcher_did_not_set_up_is_refused(monkeypatch):
    from torchfleet import Fleet, UsageError
    from torchfleet.env import replicas

    outside_replica_groups(monkeypatch)
    with pytest.raises(
        UsageError,
        match="fault_tolerance='step' needs replica groups: launch the script with"
        " torchfleet run --fault-tolerance step",
    ):
        Fleet(strategy="serial", fault_tolerance="step")
    monkeypatch.setenv(replicas.GROUP, "1")
    monkeypatch.setenv(replicas.GROUPS, "2")
    monkeypatch.setenv(replicas.LIGHTHOUSE, "http://127.0.0.1:29510")
    monkeypatch.setenv(replicas.ADDR, "127.0.0.1")
    with pytest.raises(
        UsageError,
        match="this process was started as replica group 1 of 2 .* but Fleet was given"
        " fault_tolerance='restart'; leave it out",
    ):
        Fleet(strategy="serial", fault_tolerance="restart")
    with pytest.raises(UsageError, match="unknown fault_tolerance 'always'; choose one of restart, step"):
        Fleet(strategy="serial", fault_tolerance="always")
