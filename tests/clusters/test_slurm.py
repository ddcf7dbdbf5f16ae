"""`torchfleet slurm`: the batch script it writes, and a real Slurm running it.

The cluster is Debian's slurm-wlm with munge, started on this machine by
`slurm_cluster.running()`; a job of 2 srun tasks trains examples/train_digits.py
and its weights must equal a serial run of the same global batch. Under
`--fault-tolerance step` the script's retry loops run twice: across three
pretend nodes with stand-ins for srun and scontrol (the loop, its bound, the
node addresses), and on the real cluster, where a group whose worker is killed
is started again and finishes.
"""

from __future__ import annotations

import re
import socket
import stat
import subprocess
import sys
import time

import pytest

import reference
import slurm_cluster
from helpers import EXAMPLES, ROOT, clean_env, run
from torchfleet.cli import main

SCRIPT = str(EXAMPLES / "train_digits.py")
FT_SCRIPT = str(ROOT / "tests" / "scripts" / "slurm_ft_kill.py")


def test_batch_script_for_two_gpu_nodes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "job.sbatch"
    assert (
        main(
            [
                "slurm",
                SCRIPT,
                "--nodes",
                "2",
                "--gpus-per-node",
                "4",
                "--partition",
                "gpu",
                "--time",
                "2:00:00",
                "--out",
                str(out),
                "--",
                "--epochs",
                "3",
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert f"wrote {out}: 8 processes (2 x 4)" in stdout
    assert f"sbatch {out}" in stdout
    text = out.read_text()
    assert text.startswith("#!/bin/bash\n")
    directives = re.findall(r"^#SBATCH (\S+)$", text, flags=re.M)
    assert directives == [
        "--job-name=torchfleet-train_digits",
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        "--partition=gpu",
        "--time=2:00:00",
        f"--chdir={ROOT}",
        "--output=%x-%j.out",
    ]
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert srun == f"srun --kill-on-bad-exit=1 {sys.executable} -u {SCRIPT} --epochs 3"
    assert 'OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"' in text


def test_batch_script_to_stdout_for_a_cpu_job(capsys):
    assert main(["slurm", "--out", "-", SCRIPT]) == 0
    out = capsys.readouterr().out
    assert "--ntasks-per-node=1" in out and "gpus" not in out
    assert "OMP_NUM_THREADS" not in out  # one task per node: all its cores


BAD = [
    (["--nodes", "0"], "--nodes 0 must be at least 1"),
    (["--gpus-per-node", "2", "--ntasks-per-node", "3"], "--ntasks-per-node 3 is more than --gpus-per-node 2"),
    (["--time", "two hours"], "--time 'two hours' is not a Slurm time limit"),
    (["--partition", "gpu a"], "--partition 'gpu a' is not a partition name"),
    (["--out", "-", "--submit"], "--submit needs it in a file"),
    (["--fault-tolerance", "always"], "--fault-tolerance 'always' is not a mode; choose restart"),
    (["--fault-tolerance", "step", "--max-restarts", "-1"], "--max-restarts -1 must be at least 0"),
    (["--max-restarts", "2"], "--max-restarts 2 applies with --fault-tolerance step"),
]


@pytest.mark.parametrize("flags,sentence", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input(flags, sentence, capsys):
    assert main(["slurm", SCRIPT, *flags]) == 2
    err = capsys.readouterr().err
    assert sentence in err and len(err.strip().splitlines()) == 1


def test_submit_without_sbatch_says_where_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["slurm", SCRIPT, "--out", str(tmp_path / "j.sbatch"), "--submit"]) == 2
    assert "sbatch is not on PATH; run --submit on a Slurm login node" in capsys.readouterr().err
    assert (tmp_path / "j.sbatch").is_file()  # written all the same


@pytest.mark.timeout(300)
def test_two_tasks_on_a_real_slurm_train_like_one_process(tmp_path):
    with slurm_cluster.running() as cluster:
        job_file = tmp_path / "digits.sbatch"
        # Run from tmp_path: the job's working folder (--chdir) and its output go there.
        submitted = run(
            [
                sys.executable,
                "-m",
                "torchfleet",
                "slurm",
                SCRIPT,
                "--ntasks-per-node",
                "2",
                "--out",
                str(job_file),
                "--submit",
                "--",
                "--epochs",
                "1",
                "--out",
                str(tmp_path / "slurm.pt"),
            ],
            env=clean_env(**cluster.env_extra),
            cwd=tmp_path,
        )
        assert submitted.returncode == 0, submitted.stderr
        (job_id,) = re.findall(r"Submitted batch job (\d+)", submitted.stdout)
        reference.serial_weights()  # the single-process reference trains meanwhile
        state, exit_code = cluster.wait(job_id, timeout=240)
        log = tmp_path / f"torchfleet-train_digits-{job_id}.out"
        output = log.read_text() if log.exists() else "(no output file)"
        assert (state, exit_code) == ("COMPLETED", "0:0"), output + cluster.logs()
    assert output.count("epoch 1:") == 1, output  # two tasks, one printing rank
    assert reference.max_difference(tmp_path / "slurm.pt") < 1e-5


def _ft_script(tmp_path, *flags: str) -> str:
    out = tmp_path / "ft.sbatch"
    assert main(["slurm", FT_SCRIPT, "--fault-tolerance", "step", "--out", str(out), *flags]) == 0
    return out.read_text()


def test_ft_batch_script_runs_one_restartable_group_per_node(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    text = _ft_script(tmp_path, "--nodes", "3", "--gpus-per-node", "2", "--max-restarts", "2", "--", "--lr", "0.1")
    assert "a replica group per node, each started again at most 2 times" in capsys.readouterr().out
    assert re.findall(r"^#SBATCH (\S+)$", text, flags=re.M) == [
        "--job-name=torchfleet-slurm_ft_kill",
        "--nodes=3",
        "--ntasks-per-node=2",
        "--gpus-per-node=2",
        f"--chdir={ROOT}",
        "--output=%x-%j.out",
        "--no-kill",
    ]
    lines = text.splitlines()
    assert "head=$(scontrol show node \"${nodes[0]}\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')" in lines
    assert "head=${head:-${nodes[0]}}" in lines  # the host name where no NodeAddr is shown
    assert "port=$((15000 + SLURM_JOB_ID % 10000))" in lines
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"' in lines
    # The lighthouse: one step on node 0, apart from its group, so that group can fail and start again.
    assert [line for line in lines if line.startswith("srun ")] == [
        f'srun --overlap --quiet --nodes=1 --ntasks=1 --nodelist="${{nodes[0]}}" {sys.executable} -m torchfleet'
        ' lighthouse --host "$head" --port "$port" &'
    ]
    groups = [line for line in lines if re.match(r"group \d+ srun ", line)]
    assert groups == [
        f'group {i} srun --nodes=1 --ntasks=1 --nodelist="${{nodes[{i}]}}" --kill-on-bad-exit=1'
        f" {sys.executable} -m torchfleet run --fault-tolerance step --nnodes 3 --node-rank {i}"
        f' --master-addr "$head" --lighthouse "$endpoint" -n 2 {FT_SCRIPT} --lr 0.1 &'
        for i in range(3)
    ]
    assert lines.count("pids+=($!)") == 3
    assert '        if [ "$attempt" -ge 2 ]; then' in lines  # the bound: 2 more attempts at most
    assert 'for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done' in lines
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_ft_batch_script_for_one_cpu_process_per_node_leaves_threads_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = _ft_script(tmp_path)
    assert "OMP_NUM_THREADS" not in text
    assert '        if [ "$attempt" -ge 3 ]; then' in text  # the default bound
    assert "--nnodes 1 --node-rank 0" in text and "--node-rank 1" not in text


FAKE_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf 'node-a\\nnode-b\\nnode-c\\n'; exit 0; fi
echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"
[ -n "${NO_NODE_ADDR:-}" ] || echo "   NodeAddr=10.0.0.$(( $(printf %d "'${3: -1}") - 96 )) NodeHostName=$3"
"""
# A group's srun: node-a fails once, node-b always, node-c never; each call is logged. The
# lighthouse's runs until the script stops it.
FAKE_SRUN = """#!/bin/bash
for arg; do case $arg in --nodelist=*) node=${arg#--nodelist=};; lighthouse) node=lighthouse;; esac; done
echo "$*" >> "$CALLS/$node"
[ "$node" = lighthouse ] && exec /bin/sleep 60
case $node in
  node-a) [ "$(wc -l < "$CALLS/$node")" -ge 2 ] && exit 0; exit 137;;
  node-b) exit 3;;
esac
"""


@pytest.mark.parametrize("address", [True, False], ids=["node-address", "no-node-address"])
def test_ft_batch_script_starts_failed_groups_again_within_the_bound(address, tmp_path, monkeypatch):
    """The written script, run by bash with stand-ins for srun, scontrol and sleep on three nodes."""
    monkeypatch.chdir(ROOT)
    text = _ft_script(tmp_path, "--nodes", "3", "--max-restarts", "2")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("sleep", "#!/bin/sh\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CALLS": str(calls),
        "SLURM_JOB_ID": "12345",
        "SLURM_JOB_NODELIST": "node-[a-c]",
        **({} if address else {"NO_NODE_ADDR": "1"}),
    }
    done = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert sorted(done.stderr.splitlines()) == [
        "1 of 3 replica group(s) never finished",
        "group 0 ended with status 137; starting it again (attempt 1 of 2)",
        "group 1 ended with status 3; it was started again 2 time(s), no more",
        "group 1 ended with status 3; starting it again (attempt 1 of 2)",
        "group 1 ended with status 3; starting it again (attempt 2 of 2)",
    ]
    runs = {node: (calls / node).read_text().splitlines() for node in ("lighthouse", "node-a", "node-b", "node-c")}
    assert {node: len(lines) for node, lines in runs.items()} == {
        "lighthouse": 1,
        "node-a": 2,
        "node-b": 3,
        "node-c": 1,
    }
    head = "10.0.0.1" if address else "node-a"  # node 0's address, else its name
    assert runs["lighthouse"] == [
        f"--overlap --quiet --nodes=1 --ntasks=1 --nodelist=node-a {sys.executable} -m"
        f" torchfleet lighthouse --host {head} --port 17345"
    ]
    for i, node in enumerate(("node-a", "node-b", "node-c")):
        assert set(runs[node]) == {
            f"--nodes=1 --ntasks=1 --nodelist={node} --kill-on-bad-exit=1 {sys.executable} -m torchfleet run"
            f" --fault-tolerance step --nnodes 3 --node-rank {i} --master-addr {head} --lighthouse {head}:17345"
            f" -n 1 {FT_SCRIPT}"
        }


def _bindable(port: int) -> bool:
    with socket.socket() as sock:  # no SO_REUSEADDR: as the lighthouse checks its port
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _skip_ids_whose_ports_linger(cluster, count: int) -> None:
    """Job ids start at 1 again in each test cluster, and an ft job's lighthouse port is 15000 + id %
    10000: an earlier test's job of the same id may have left that port in TIME_WAIT, which the
    lighthouse refuses. Use up ids (jobs that run `true`) until the next `count` jobs' ports bind."""
    for _ in range(20):
        out = cluster.command("sbatch", "--output=/dev/null", "--wrap", "true")
        (last,) = re.findall(r"Submitted batch job (\d+)", out.stdout)
        if all(_bindable(15000 + (int(last) + k) % 10000) for k in range(1, count + 1)):
            return
    raise AssertionError(f"no free lighthouse ports after job {last}")


@pytest.mark.waits
@pytest.mark.timeout(420)  # 157 s of 180 in CI (30 Nov): two jobs' restarts under CI's load
def test_ft_job_on_a_real_slurm_starts_a_killed_group_again(tmp_path):
    """Two ft jobs of one node at once: in the first the worker is killed after step 2 on the first
    attempt only, and the group started again trains to the end; in the second it is killed on every
    attempt, and the job fails after its one restart."""
    with slurm_cluster.running() as cluster:
        start = time.monotonic()
        _skip_ids_whose_ports_linger(cluster, 2)
        jobs = {}
        for name, fault, bound in (("heals", f"once={tmp_path / 'fired'}", []), ("bound", "", ["--max-restarts", "1"])):
            folder = tmp_path / name
            folder.mkdir()
            env = clean_env(**cluster.env_extra, TORCHFLEET_FAULT=f"kill:rank=0:step=2:{fault}".rstrip(":"))
            submitted = run(
                [
                    sys.executable,
                    "-m",
                    "torchfleet",
                    "slurm",
                    FT_SCRIPT,
                    "--fault-tolerance",
                    "step",
                    *bound,
                    "--out",
                    str(folder / "ft.sbatch"),
                    "--submit",
                ],
                env=env,
                cwd=folder,
            )
            assert submitted.returncode == 0, submitted.stderr
            (jobs[name],) = re.findall(r"Submitted batch job (\d+)", submitted.stdout)
        ended, outputs = {}, {}
        for name, job_id in jobs.items():
            ended[name] = cluster.wait(job_id, timeout=300)
            log = tmp_path / name / f"torchfleet-slurm_ft_kill-{job_id}.out"
            outputs[name] = log.read_text() if log.exists() else "(no output file)"
        seconds = time.monotonic() - start
        assert ended == {"heals": ("COMPLETED", "0:0"), "bound": ("FAILED", "1:0")}, (
            str(ended) + "\n".join(outputs.values()) + cluster.logs()
        )
    print(f"the two ft jobs took {seconds:.1f} s")
    heals, bound = outputs["heals"], outputs["bound"]
    # The lighthouse listened on node 0's NodeAddr (127.0.0.1 here), at the job's own port, all along.
    port = 15000 + int(jobs["heals"]) % 10000
    assert heals.count(f"lighthouse listening on http://127.0.0.1:{port}") == 1, heals
    assert heals.count(f"the lighthouse at 127.0.0.1:{port} answers") == 2, heals
    assert heals.count("replica group 0 of 1") == 2, heals
    restart = "group 0 ended with status 137; starting it again (attempt 1 of 3)"
    assert heals.count(restart) == 1, heals
    assert heals.count("trained 6 steps") == 1 and heals.index(restart) < heals.index("trained 6 steps"), heals
    assert (tmp_path / "fired").exists()
    assert "every replica group has ended; stopping the lighthouse" in heals, heals
    assert "starting it again (attempt 1 of 1)" in bound, bound
    assert "group 0 ended with status 137; it was started again 1 time(s), no more" in bound, bound
    assert "1 of 1 replica group(s) never finished" in bound and "trained" not in bound, bound


def test_requeue_batch_script_signals_saves_and_requeues(tmp_path, monkeypatch, capsys):
    """`train --requeue`: the signal and requeue directives, `torchfleet train ... --resume auto` in
    every task, and the requeue after a save; the script run by bash with stand-ins for srun and
    scontrol, whose srun ends as a preempted step does (status 143 from the task killed after
    the other's 75, the note written)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "train.sbatch"
    assert (
        main(
            [
                "slurm",
                "train",
                "--requeue",
                "--ntasks-per-node",
                "2",
                "--time",
                "1:00:00",
                "--out",
                str(out),
                "--",
                "--checkpoint-dir",
                "ck",
                "--epochs",
                "3",
            ]
        )
        == 0
    )
    assert "saving on SIGUSR1 (120 s before the time limit) or SIGTERM and requeueing itself" in capsys.readouterr().out
    text = out.read_text()
    assert re.findall(r"^#SBATCH (\S+)$", text, flags=re.M) == [
        "--job-name=torchfleet-train",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--time=1:00:00",
        f"--chdir={ROOT}",
        "--output=%x-%j.out",
        "--signal=USR1@120",
        "--requeue",
        "--open-mode=append",
    ]
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert srun == (
        f"srun --kill-on-bad-exit=1 {sys.executable} -u -m torchfleet train --checkpoint-dir ck"
        " --epochs 3 --resume auto || status=$?"
    )
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "srun": '#!/bin/bash\necho "$*" >> "$CALLS"\n[ -n "${PREEMPT:-}" ] || exit 0\n'
        'echo "preempted by SIGUSR1 at step 10, checkpoint saved to ck/step-00000010, resume with'
        ' --resume" > "$TORCHFLEET_PREEMPT_NOTE"\nexit 143\n',
        "scontrol": '#!/bin/bash\necho "scontrol $*" >> "$CALLS"\n',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    for preempted, status in ((True, 75), (False, 0)):
        calls = tmp_path / f"calls-{preempted}"
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "CALLS": str(calls),
            "SLURM_JOB_ID": "42",
            "TMPDIR": str(tmp_path),
            **({"PREEMPT": "1"} if preempted else {}),
        }
        done = subprocess.run(["bash", str(out)], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == status, done.stdout + done.stderr
        lines = calls.read_text().splitlines()
        assert lines[0].endswith("--resume auto")
        assert lines[1:] == (["scontrol requeue 42"] if preempted else []), lines
        assert ("requeueing job 42" in done.stdout) == preempted, done.stdout
        assert not (tmp_path / "torchfleet-preempt-42").exists()  # the note is cleared for the next run


REQUEUE_BAD = [
    (["train", "--requeue"], "--requeue needs --checkpoint-dir among train's arguments"),
    (
        ["train", "--requeue", "--fault-tolerance", "step", "--", "--checkpoint-dir", "ck"],
        "`train` under --fault-tolerance step is not written by torchfleet slurm",
    ),
    ([SCRIPT, "--requeue", "--fault-tolerance", "step"], "--requeue applies with --fault-tolerance restart"),
]


@pytest.mark.parametrize("argv,sentence", REQUEUE_BAD, ids=[" ".join(a) for a, _ in REQUEUE_BAD])
def test_requeue_bad_input(argv, sentence, capsys):
    assert main(["slurm", *argv]) == 2
    err = capsys.readouterr().err
    assert sentence in err and len(err.strip().splitlines()) == 1
