"""The docs name only what exists, cover every flag, and their runnable examples run.

`make docs` (MkDocs --strict) catches broken links, anchors and pages; these tests catch what it
cannot see: a repository path, a command, a flag or a make target named in README.md or docs/
that is not there, a flag the generated reference leaves out, and an example marked
`<!-- run -->` that no longer runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, clean_env
from torchfleet import cli

# Appended, not put first, and named docs_*: tests/ has a reference.py of its own that must stay the one
# `import reference` finds (putting docs/hooks first shadowed it for every later test file).
sys.path.append(str(ROOT / "docs" / "hooks"))
import docs_reference as reference  # noqa: E402  (the generated Reference pages)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The commands that take a script (or module) and pass what follows it to the script.
SCRIPT_COMMANDS = {"run", "slurm", "sagemaker", "k8s"}
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
PATH = re.compile(
    r"^(?:src|tests|benchmarks|docs|examples|\.ci)/[\w./-]*\w/?$|^(?:Makefile|pyproject\.toml|mkdocs\.yml)$"
)


# The same walk of the parsers the generated reference makes.
COMMANDS = {name: parser for name, _, parser in reference._subcommands(cli.build_parser())}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def _code(text: str) -> list[str]:
    """Every code block's lines and every inline code span of a page."""
    blocks = [line for block in FENCE.findall(text) for line in block.splitlines()]
    prose = FENCE.sub("", text)
    return blocks + INLINE.findall(prose)


def _torchfleet_calls(snippet: str) -> list[list[str]]:
    """The arguments after each `torchfleet` in a line of code, up to a pipe, `;`, `&&` or comment."""
    calls = []
    for part in re.split(r"\|\||&&|[|;]|\s#", snippet):
        try:
            words = shlex.split(part, comments=False)
        except ValueError:
            words = part.split()
        words = [w for w in words if w != "\\"]
        for i, word in enumerate(words):
            if word in ("torchfleet", ".venv/bin/torchfleet") and (i == 0 or words[i - 1] in ("-m", "$", "sudo")):
                calls.append(words[i + 1 :])
    return calls


def _problems_in_call(args: list[str]) -> list[str]:
    if not args or args[0] in ("-h", "--help", "--version") or not re.fullmatch(r"[a-z0-9]+", args[0]):
        return []
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        return [f"torchfleet {command}: no such command"]
    options, problems = _options(COMMANDS[command]), []
    takes_value = False
    for word in rest:
        if takes_value:
            takes_value = False
            continue
        if word.startswith("-") and len(word) > 1 and not re.fullmatch(r"-[\d.]+", word):
            flag = word.split("=", 1)[0]
            action = options.get(flag)
            if action is None:
                problems.append(f"torchfleet {command} {flag}: no such flag")
                continue
            takes_value = "=" not in word and action.nargs != 0 and action.nargs != "?"
        elif command in SCRIPT_COMMANDS:
            break  # the script; what follows is its own
    return problems


TARGETS = set(re.findall(r"^([\w./-]+):", (ROOT / "Makefile").read_text(), re.M))
FLAGS = {s for p in COMMANDS.values() for s in _options(p)}


def _problems(name: str, text: str) -> list[str]:
    problems = []
    for snippet in _code(text):
        for call in _torchfleet_calls(snippet):
            problems += _problems_in_call(call)
        for word in snippet.split():
            word = word.strip("`'\",;:()").rstrip(".")
            if PATH.match(word) and "*" not in word and not (ROOT / word).exists():
                problems.append(f"{word}: no such file or directory in the repository")
        made = re.match(r"^\s*(?:\$ )?make ([\w./-]+)", snippet)
        if made and made.group(1) not in TARGETS and "=" not in made.group(1):
            problems.append(f"make {made.group(1)}: no such target in the Makefile")
        # An inline span that is only a flag names one of torchfleet's (torchrun's are `run`'s too).
        alone = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =][^ ]*)?", snippet.strip())
        if alone and alone.group(1) not in FLAGS and alone.group(1) not in FOREIGN_FLAGS:
            problems.append(f"{alone.group(1)}: no command of torchfleet has this flag")
    return [f"{name}: {p}" for p in problems]


# Flags of other tools that the docs name on their own: pytest's (tests/conftest.py's --floor-lane
# among them), pip's, MkDocs', mpirun's, sbatch's and srun's, and a script's own in an example.
FOREIGN_FLAGS = {
    "--durations",
    "--floor-lane",
    "--strict",
    "--no-deps",
    "--allow-run-as-root",
    "--open-mode",
    "--chdir",
    "--kill-on-bad-exit",
    "--overlap",
    "--requeue",
    "--signal",
    "--name",
}


def test_the_docs_name_only_paths_commands_flags_and_targets_that_exist():
    problems = [p for page in PAGES for p in _problems(str(page.relative_to(ROOT)), page.read_text())]
    assert not problems, "\n".join(problems)


# A path in the code's own comments and docstrings: from the repository's root, or from the package's
# (strategies/registry.py), ending in a file's suffix.
PACKAGE = ROOT / "src" / "torchfleet"
CODE_PATH = re.compile(
    r"(?<![\w./-])((?:src|tests|benchmarks|docs|examples|"
    + "|".join(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    + r")/[\w./-]*\.(?:py|md|toml|yml|json))\b"
)


def _code_paths_that_do_not_exist(files) -> list[str]:
    return [
        f"{f.relative_to(ROOT)}: {m}"
        for f in files
        for m in CODE_PATH.findall(f.read_text())
        if not any((base / m).exists() for base in (ROOT, PACKAGE))
    ]


def test_the_code_names_only_paths_that_exist():
    """strategies/__init__.py once named a sync.py of the replica groups' that did not exist; this file's
    replica_groups/sync.py, which does not either, is its own self-test's."""
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(f for f in (ROOT / "tests").rglob("*.py") if f.name != "test_docs.py"),
    ]
    assert not (missing := _code_paths_that_do_not_exist(files)), "\n".join(missing)
    planted = _code_paths_that_do_not_exist([ROOT / "tests" / "test_docs.py"])  # this file names two on purpose
    assert {line.split(": ")[1] for line in planted} == {"replica_groups/sync.py", "src/torchfleet/nothing.py"}


def test_the_checker_finds_a_flag_a_path_a_command_and_a_target_that_do_not_exist():
    page = (
        "Run `torchfleet train --strategy ddp --stratgy fsdp`, read `src/torchfleet/nothing.py`,\n"
        "then\n\n```bash\nmake tset\ntorchfleet plann\ntorchfleet run -n 2 train.py --epochs 3\n```\n"
    )
    found = [p.split(": ", 1)[1] for p in _problems("page.md", page)]
    assert sorted(found) == sorted(
        [
            "torchfleet train --stratgy: no such flag",
            "src/torchfleet/nothing.py: no such file or directory in the repository",
            "torchfleet plann: no such command",
            "make tset: no such target in the Makefile",
        ]
    ), found


def test_every_flag_of_every_command_is_in_the_generated_reference():
    page = reference.commands()
    sections = dict(re.findall(r"^## torchfleet (\S+) \{ #\S+ \}\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    assert set(sections) == set(COMMANDS)
    for name, parser in COMMANDS.items():
        shown = [
            a
            for a in parser._actions
            if a.help != argparse.SUPPRESS and a.option_strings and not isinstance(a, argparse._HelpAction)
        ]
        assert shown, name
        for action in shown:
            for spelling in action.option_strings:
                assert f"`{spelling}`" in sections[name], f"torchfleet {name} {spelling} is not in the reference"


def _runnable_blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for i, block in enumerate(re.findall(r"^<!-- run -->\n```[^\n]*\n(.*?)^```", page.read_text(), re.M | re.S)):
            found.append((f"{page.relative_to(ROOT)}#{i}", block))
    return found


RUNNABLE = _runnable_blocks()


def test_there_are_runnable_examples():
    assert len(RUNNABLE) >= 3, [name for name, _ in RUNNABLE]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [b for _, b in RUNNABLE], ids=[n for n, _ in RUNNABLE])
def test_a_runnable_example_runs(block, tmp_path):
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run(["bash", "-e", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
