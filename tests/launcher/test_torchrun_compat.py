"""`torchfleet run` is a drop-in for torchrun: every flag of the installed torch, both spellings,
gives torchrun's agent what torchrun gives it."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

import pytest
from torch.distributed.run import config_from_args, get_args_parser

from helpers import clean_env, run, torchfleet
from torchfleet.cli import _launch_config, build_parser
from torchfleet.errors import UsageError
from torchfleet.launcher.elastic_config import agent_config
from torchfleet.launcher.torchrun_flags import PREFIX, agent_overrides, given, torchrun_actions

# A valid value for each flag that takes one (the rest get their first choice, or "1").
VALUES = {
    "nnodes": "1",
    "nproc_per_node": "2",
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "localhost:29400",
    "rdzv_id": "job",
    "rdzv_conf": "timeout=5",
    "max_restarts": "1",
    "monitor_interval": "0.5",
    "event_log_handler": "null",
    "role": "trainer",
    "log_dir": "/tmp/logs",
    "redirects": "3",
    "tee": "3",
    "log_line_prefix_template": "[${rank}]",
    "local_ranks_filter": "0",
    "duplicate_stdout_filters": "err",
    "duplicate_stderr_filters": "err",
    "node_rank": "0",
    "master_addr": "127.0.0.1",
    "master_port": "29500",
    "local_addr": "127.0.0.1",
    "signals_to_handle": "SIGTERM",
    "shutdown_timeout": "5",
    "logs_specs": "default",
}
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


# -- what each flag gives torchrun's agent, without starting anything ---------------------------
# Values unlike torchrun's defaults and CONTEXTS', so that a flag whose value never reached the agent shows.
AGENT_VALUES = {
    "nnodes": "3",
    "nproc_per_node": "3",
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "10.1.2.3:29400",
    "rdzv_id": "job7",
    "rdzv_conf": "timeout=5",
    "max_restarts": "2",
    "monitor_interval": "0.5",
    "start_method": "fork",
    "event_log_handler": "console",
    "role": "trainer",
    "log_dir": "LOGS",
    "redirects": "3",
    "tee": "2",
    "log_line_prefix_template": "[${rank}]",
    "local_ranks_filter": "0,1",
    "duplicate_stdout_filters": "err",
    "duplicate_stderr_filters": "warn",
    "node_rank": "1",
    "master_addr": "10.4.5.6",
    "master_port": "29522",
    "local_addr": "10.9.8.7",
    "signals_to_handle": "SIGTERM",
    "shutdown_timeout": "5",
    "numa_binding": "node",
    "logs_specs": "default",
}
# Each flag is compared on one machine and, after these, on two (torchrun's static rendezvous).
CONTEXTS = {"one machine": [], "two machines": ["--nnodes", "2", "--master-addr", "10.1.2.3", "--master-port", "29511"]}
# Agent fields where torchfleet differs from torchrun on purpose, when no flag of the user's sets them.
ON_PURPOSE = {
    "one machine": {
        "run_id": "a fresh id per run, as torchrun --standalone draws one (torchrun without it says 'none')",
        "rdzv_backend": "torchfleet's loopback c10d rendezvous: its stores listen on 127.0.0.1 only",
        "rdzv_endpoint": "loopback and a port the OS picks (torchrun: the master's address and port)",
        "rdzv_configs": "the loopback rendezvous takes no node rank",
        "local_addr": "loopback, so the workers' MASTER_ADDR names no network interface",
    },
    "two machines": {
        "run_id": "'torchfleet', the same on every machine without --rdzv-id (torchrun: 'none')",
        "local_addr": "the address that routes to the master: torch's default, the host name, may resolve"
        " to 127.0.0.1, and then ranks on the other machines never connect",
    },
}
# Fields where, in one context, torchfleet does not follow what a flag does to torchrun's config.
OVERRIDDEN = {
    ("one machine", "rdzv_backend"): (
        {"rdzv_backend", "rdzv_endpoint", "rdzv_configs"},
        "one machine keeps torchfleet's loopback rendezvous",
    ),
    ("one machine", "rdzv_conf"): ({"rdzv_configs"}, "one machine keeps the loopback rendezvous' options"),
    ("one machine", "rdzv_endpoint"): (
        {"rdzv_endpoint"},
        "one machine keeps its loopback rendezvous, which opens nothing to the network",
    ),
    ("one machine", "master_addr"): (
        {"rdzv_endpoint"},
        "one machine keeps loopback; --master-addr counts with --nnodes above 1",
    ),
    ("one machine", "local_addr"): ({"local_addr"}, "one machine keeps loopback"),
    ("two machines", "rdzv_backend"): (
        {"rdzv_endpoint", "rdzv_configs"},
        "torchrun leaves a c10d endpoint"
        " empty (its handler then tries localhost); torchfleet keeps the master's"
        " address and port, and its options (the node's rank) beside torchrun's",
    ),
    ("two machines", "rdzv_endpoint"): (
        {"rdzv_backend", "rdzv_configs"},
        "an endpoint makes torchfleet's"
        " rendezvous c10d (elastic, is_host where it is local) where torchrun"
        " keeps static: test_elastic runs that case for real",
    ),
}
# Flag values torchfleet refuses in one context, where torchrun would start and wait.
REFUSED = {("one machine", "node_rank"): "node rank 1 of --nnodes 1 can never meet a node 0"}
# Flags that change nothing in torchrun's agent configuration (config_from_args), only how it runs.
NO_AGENT_EFFECT = {
    "standalone": "torchrun's run() turns it into a c10d rendezvous before config_from_args; torchfleet's"
    " one machine always is one (test_torchrun_flags_give_the_ranks_what_torchrun_gives)",
    "module": "how each worker starts the script (-m), not the agent: the ranks' test runs it",
    "no_python": "how each worker starts the program, not the agent: test_no_python_runs_a_program",
    "run_path": "how each worker starts the script (runpy.run_path), not the agent",
    "logs_specs": "the only log-specs class installed is torchrun's default, so no value can change the config",
}


def _comparable(config, temp: str) -> dict:
    """An agent configuration as plain values: log specs by their attributes, temp dirs named alike."""
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "logs_specs":
            value = {
                k: "<a new temporary directory>" if str(v).startswith(temp) else v for k, v in vars(value).items()
            } | {"class": type(value).__name__}
        out[field.name] = value
    return out


def _torchfleet_config(words: list[str], temp: str) -> dict:
    # What `torchfleet run` hands the agent (cmd_run -> run_script -> agent_config), built the same way.
    args, extra = build_parser().parse_known_args(["run", *words, "train.py"])
    assert extra == []
    cfg = _launch_config(args)
    overrides = agent_overrides(given(args), args.script, args.script_args, one_machine=not cfg.multi_node)
    return _comparable(agent_config(cfg, overrides), temp)


def _torchrun_config(words: list[str], temp: str) -> dict:
    config, _, _ = config_from_args(get_args_parser().parse_args([*words, "train.py"]))
    return _comparable(config, temp)


ACTIONS = torchrun_actions()


@pytest.mark.parametrize("action", ACTIONS, ids=[a.option_strings[-1] for a in ACTIONS])
def test_every_torchrun_flag_gives_the_agent_what_torchrun_gives(action, tmp_path, monkeypatch):
    temp = str(tmp_path / "temp")
    os.mkdir(temp)
    monkeypatch.setattr(tempfile, "tempdir", temp)  # DefaultLogsSpecs makes a directory when given none
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # config_from_args sets it; restored after
    flag = action.option_strings[-1]
    value = AGENT_VALUES.get(action.dest) or (action.choices[0] if action.choices else "1")
    words = [flag] if action.nargs == 0 else [flag, str(tmp_path / "logs") if value == "LOGS" else value]
    compared = 0
    for context, before in CONTEXTS.items():
        if (context, action.dest) in REFUSED:
            with pytest.raises(UsageError):
                _torchfleet_config([*before, *words], temp)
            continue
        base = _torchrun_config(before, temp)
        theirs = _torchrun_config([*before, *words], temp)
        ours = _torchfleet_config([*before, *words], temp)
        effect = {name for name in theirs if theirs[name] != base[name]}
        # A field torchfleet sets itself is excused only while the flag leaves torchrun's value alone.
        excused = (set(ON_PURPOSE[context]) - effect) | OVERRIDDEN.get((context, action.dest), (set(), ""))[0]
        for name in theirs:
            if name not in excused:
                assert ours[name] == theirs[name], (
                    f"{' '.join(words)} ({context}): torchfleet gives the agent {name}={ours[name]!r},"
                    f" torchrun {theirs[name]!r}"
                )
        compared += len(effect - excused)
    if action.dest in NO_AGENT_EFFECT:
        assert compared == 0, f"{flag} now changes torchrun's agent config: take it off NO_AGENT_EFFECT"
    else:
        assert compared, (
            f"{' '.join(words)} changes nothing compared in torchrun's agent config: pick another"
            " value in AGENT_VALUES, or say why in NO_AGENT_EFFECT"
        )


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
        "    json.dump(seen, fh)\n"
    )
    flags = [
        "--standalone",
        "--nproc_per_node=2",
        "--rdzv-backend",
        "c10d",
        "--max_restarts",
        "1",
        "--role",
        "trainer",
        "--local-ranks-filter",
        "0",
        "--tee",
        "3",
        "--monitor_interval",
        "0.2",
    ]
    results = {}
    for name, command in (
        ("torchfleet", [sys.executable, "-m", "torchfleet", "run"]),
        ("torchrun", [sys.executable, "-m", "torch.distributed.run"]),
    ):
        out, logs = tmp_path / f"{name}-out", tmp_path / f"{name}-logs"
        out.mkdir()
        result = run(
            [*command, *flags, "--log_dir", str(logs), "-m", "pkg.show", "--epochs", "3"],
            env=clean_env(SHOW_OUT=str(out), PYTHONPATH=str(tmp_path)),
            cwd=tmp_path,
            timeout=200,
        )
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
