"""`torchfleet run` is a drop-in for torchrun: every flag of the installed torch, both spellings."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import clean_env, run, torchfleet
from torchfleet.cli import build_parser
from torchfleet.launcher.torchrun_flags import PREFIX, torchrun_actions

# A valid value for each flag that takes one (the rest get their first choice, or "1").
VALUES = {"nnodes": "1", "nproc_per_node": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "localhost:29400",
          "rdzv_id": "job", "rdzv_conf": "timeout=5", "max_restarts": "1", "monitor_interval": "0.5",
          "event_log_handler": "null", "role": "trainer", "log_dir": "/tmp/logs", "redirects": "3",
          "tee": "3", "log_line_prefix_template": "[${rank}]", "local_ranks_filter": "0",
          "duplicate_stdout_filters": "err", "duplicate_stderr_filters": "err", "node_rank": "0",
          "master_addr": "127.0.0.1", "master_port": "29500", "local_addr": "127.0.0.1",
          "signals_to_handle": "SIGTERM", "shutdown_timeout": "5", "logs_specs": "default"}
FLAGS = [(option, action) for action in torchrun_actions() for option in action.option_strings]


@pytest.mark.parametrize("option,action", FLAGS, ids=[o for o, _ in FLAGS])
def test_every_torchrun_flag_parses(option, action):
    words = ["run", option]
    if action.nargs != 0:
        words.append(VALUES.get(action.dest) or (action.choices[0] if action.choices else "1"))
    args, extra = build_parser().parse_known_args([*words, "train.py", "--lr", "1"])
    assert extra == [] and args.script == "train.py" and args.script_args == ["--lr", "1"]
    got = vars(args)
    value = got.get(action.dest, got.get(PREFIX + action.dest))
    if action.nargs == 0:
        assert value is True, f"{option} was not kept"
    else:  # kept as given (a comma-separated flag as its list)
        assert str(value) in (words[-1], str(words[-1].split(","))), f"{option} {words[-1]} kept as {value!r}"


def _seen(directory) -> dict:
    out = {}
    for path in sorted(directory.glob("rank*.json")):
        seen = json.loads(path.read_text())
        seen.pop("MASTER_ADDR")  # torchrun --standalone advertises the host name, torchfleet loopback
        out[path.stem] = seen
    return out


@pytest.mark.timeout(240)
def test_torchrun_flags_give_the_ranks_what_torchrun_gives(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "show.py").write_text(
        "import json, os, sys\n"
        "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'ROLE_RANK',\n"
        "        'ROLE_WORLD_SIZE', 'ROLE_NAME', 'MASTER_ADDR', 'TORCHELASTIC_MAX_RESTARTS', 'OMP_NUM_THREADS']\n"
        "seen = {k: os.environ.get(k) for k in keys}\n"
        "seen['argv'] = sys.argv[1:]\n"
        "print(f\"rank {seen['RANK']} says hello\", flush=True)\n"
        "with open(os.path.join(os.environ['SHOW_OUT'], f\"rank{seen['RANK']}.json\"), 'w') as fh:\n"
        "    json.dump(seen, fh)\n")
    flags = ["--standalone", "--nproc_per_node=2", "--rdzv-backend", "c10d", "--max_restarts", "1",
             "--role", "trainer", "--local-ranks-filter", "0", "--tee", "3", "--monitor_interval", "0.2"]
    results = {}
    for name, command in (("torchfleet", [sys.executable, "-m", "torchfleet", "run"]),
                          ("torchrun", [sys.executable, "-m", "torch.distributed.run"])):
        out, logs = tmp_path / f"{name}-out", tmp_path / f"{name}-logs"
        out.mkdir()
        result = run([*command, *flags, "--log_dir", str(logs), "-m", "pkg.show", "--epochs", "3"],
                     env=clean_env(SHOW_OUT=str(out), PYTHONPATH=str(tmp_path)), cwd=tmp_path, timeout=200)
        assert result.returncode == 0, result.stderr
        results[name] = (_seen(out), result.stdout, logs)
    ours, theirs = results["torchfleet"][0], results["torchrun"][0]
    assert ours == theirs and len(ours) == 2
    assert ours["rank1"]["ROLE_NAME"] == "trainer" and ours["rank1"]["argv"] == ["--epochs", "3"]
    assert ours["rank0"]["TORCHELASTIC_MAX_RESTARTS"] == "1"
    stdout, logs = results["torchfleet"][1], results["torchfleet"][2]
    # --tee with --local-ranks-filter 0: rank 0 on the console, every rank in --log-dir.
    assert "rank 0 says hello" in stdout and "rank 1 says hello" not in stdout
    (rank1_log,) = logs.glob("*/attempt_0/1/stdout.log")
    assert "rank 1 says hello" in rank1_log.read_text()


@pytest.mark.timeout(120)
def test_no_python_runs_a_program(tmp_path):
    result = torchfleet("run", "--no_python", "-n", "2", "sh", "-c", f"echo $RANK/$WORLD_SIZE > {tmp_path}/$RANK")
    assert result.returncode == 0, result.stderr
    assert sorted(p.read_text().strip() for p in tmp_path.iterdir()) == ["0/2", "1/2"]


def test_a_usage_error_names_the_commands_help():
    result = torchfleet("run", "--bogus", "train.py")
    assert result.returncode == 2
    assert result.stderr.strip() == "torchfleet run: error: unrecognized arguments: --bogus (see torchfleet run --help)"
