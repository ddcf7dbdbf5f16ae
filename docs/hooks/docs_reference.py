"""The Reference pages, written from the code at build time: nothing here is copied by hand.

commands.md comes from the parsers `torchfleet --help` prints, train-config.md from TrainConfig's
fields, api.md from docstrings (mkdocstrings), environment.md from the TORCHFLEET_* names the
source reads, exit-codes.md from the launcher's constants. Where a page needs words the code
does not hold (what a variable is for, what an exit status means), docs_registry.py holds them, and
the build stops when a name in the source has no words or the words name something gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import docs_registry as registry

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    return [(name, helps.get(name, ""), p) for name, p in sub.choices.items()]


def _flag_rows(parser: argparse.ArgumentParser) -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """(group title, rows of (flags, value, default, help)) for every group with a shown flag."""
    formatter = parser._get_formatter()
    groups = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
            if action.nargs == 0:
                value = ""
            elif action.choices:
                value = " \\| ".join(f"`{c}`" for c in action.choices)
            else:
                value = f"`{formatter._metavar_formatter(action, action.dest.upper())(1)[0]}`"
            default = action.default
            shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
            text = formatter._expand_help(action) if action.help else ""
            rows.append((names, value, shown, _cell(text)))
        if rows:
            groups.append((group.title or "options", rows))
    return groups


def commands() -> str:
    from torchfleet import cli

    parser = cli.build_parser()
    out = [
        "# Commands",
        "",
        "Every command and flag of `torchfleet`, read from its parsers when this site was built"
        " (`torchfleet COMMAND --help` prints the same). `run` also takes each flag in torchrun's"
        " underscore spelling (`--nproc_per_node`).",
        "",
    ]
    for name, summary, sub in _subcommands(parser):
        out += [f"## torchfleet {name} {{ #{name} }}", "", f"{summary[:1].upper()}{summary[1:]}.", ""]
        if sub.description:
            out += [sub.description.strip(), ""]
        out += ["```", sub.format_usage().strip(), "```", ""]
        for title, rows in _flag_rows(sub):
            out += [
                f"**{title[:1].upper()}{title[1:]}**",
                "",
                "| flag | value | default | what it does |",
                "| --- | --- | --- | --- |",
            ]
            out += [f"| {' | '.join(row)} |" for row in rows]
            out.append("")
    return "\n".join(out)


def train_config() -> str:
    from torchfleet.train.config import TrainConfig

    out = [
        "# Training configuration",
        "",
        "`TrainConfig` holds everything `torchfleet train` runs; each field is also the `train` flag of"
        " the same name (`batch_size` is `--batch-size`), declared once in"
        " `src/torchfleet/train/config.py`. Read from the class when this site was built.",
        "",
        "| field | flag | type | default | what it does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in dataclasses.fields(TrainConfig):
        helptext = f.metadata.get("help", "")
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "")
        )
        helptext = helptext.replace("%(default)s", str(default))
        flag = f"`--{f.name.replace('_', '-')}`" if "help" in f.metadata else ""
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append(f"| `{f.name}` | {flag} | `{_cell(kind)}` | `{_cell(default)}` | {_cell(helptext)} |")
    return "\n".join(out) + "\n"


def api() -> str:
    return "\n".join(
        [
            "# Python API",
            "",
            "What a training script imports, from the docstrings in `src/torchfleet/` when this site was built.",
            "",
            "::: torchfleet.Fleet",
            "",
            "::: torchfleet.launch",
            "",
            "::: torchfleet.notebook_launch",
            "",
            "::: torchfleet.hogwild.run",
            "",
            "::: torchfleet.strategies.registry.Preset",
            "",
            "::: torchfleet.strategies.registry.register",
            "",
            "::: torchfleet.UsageError",
            "",
        ]
    )


def _variables_in_source() -> dict[str, list[str]]:
    """Every TORCHFLEET_* name in src/ (and the tests' helpers.py), with the files that name it."""
    found: dict[str, set[str]] = {}
    for path in [*sorted((SRC / "torchfleet").rglob("*.py")), ROOT / "tests" / "helpers.py"]:
        for name in set(re.findall(r"\bTORCHFLEET_[A-Z0-9_]+\b", path.read_text())):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return {name: sorted(paths) for name, paths in sorted(found.items())}


def environment() -> str:
    found = _variables_in_source()
    undescribed = sorted(set(found) - set(registry.VARIABLES))
    gone = sorted(set(registry.VARIABLES) - set(found))
    if undescribed or gone:
        raise SystemExit(
            f"docs: environment variables without a description in docs/hooks/docs_registry.py:"
            f" {undescribed or 'none'}; described but no longer in src/: {gone or 'none'}"
        )
    out = [
        "# Environment variables",
        "",
        "Every `TORCHFLEET_*` variable the source reads, found in `src/` when this site was built.",
        "",
    ]
    headings = {"users": "Set by you", "launcher": "Set by torchfleet's launcher for its workers", "tests": "For tests"}
    unknown = {who for who, _ in registry.VARIABLES.values()} - set(headings)
    if unknown:
        raise SystemExit(
            f"docs: docs/hooks/docs_registry.py names who sets a variable as {sorted(unknown)};"
            f" use one of {', '.join(headings)}"
        )
    for audience, heading in headings.items():
        rows = [(n, m) for n, (who, m) in registry.VARIABLES.items() if who == audience]
        out += [f"## {heading}", "", "| variable | what it does | named in |", "| --- | --- | --- |"]
        out += [f"| `{n}` | {_cell(m)} | {', '.join(f'`{p}`' for p in found[n])} |" for n, m in sorted(rows)]
        out.append("")
    return "\n".join(out)


def exit_codes() -> str:
    out = [
        "# Exit codes",
        "",
        "What `torchfleet train` and `torchfleet run` return, and what each status means. The values"
        " come from the launcher's constants when this site was built.",
        "",
        "| status | name in the code | meaning |",
        "| --- | --- | --- |",
    ]
    for status, constant, meaning in registry.exit_codes():
        out.append(f"| {status} | {f'`{constant}`' if constant else ''} | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


PAGES = {
    "reference/commands.md": commands,
    "reference/train-config.md": train_config,
    "reference/api.md": api,
    "reference/environment.md": environment,
    "reference/exit-codes.md": exit_codes,
}
