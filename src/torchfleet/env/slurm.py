"""Slurm's compressed notations, parsed as Slurm itself expands them.

Host lists ("node[01-03,07]") and task counts per node ("2(x3),1") appear in
the variables srun sets. Errors are ValueErrors saying what is wrong; slurm_layout.py
turns them into one sentence naming the variable.
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS_ENTRY = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def hosts(hostlist: str) -> list[str]:
    """ "node[01-03,07]" -> node01 node02 node03 node07, as ``scontrol show hostnames`` does."""
    return [host for entry in _split_hosts(hostlist.strip()) for host in _expand_host(entry)]


def task_counts(value: str) -> list[int]:
    """ "2(x3),1" -> [2, 2, 2, 1]: one count per node."""
    counts: list[int] = []
    for entry in value.strip().split(","):
        match = _TASKS_ENTRY.fullmatch(entry.strip())
        if match is None:
            raise ValueError(f"{entry.strip()!r} is not a count like 2 or 2(x3)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _split_hosts(hostlist: str) -> list[str]:
    """Split at the commas between hosts, not those inside brackets."""
    entries, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError("its brackets are unbalanced or nested")
        if char == "," and depth == 0:
            entries.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError("a '[' is never closed")
    entries.append(hostlist[start:])
    if not all(entries):
        raise ValueError("it has an empty host name")
    return entries


def _expand_host(entry: str) -> list[str]:
    opening = entry.find("[")
    if opening < 0:
        return [entry]
    closing = entry.index("]", opening)  # _split_hosts checked the brackets balance
    prefix, body, rest = entry[:opening], entry[opening + 1 : closing], entry[closing + 1 :]
    tails = _expand_host(rest)
    return [prefix + number + tail for number in _expand_ranges(body) for tail in tails]


def _expand_ranges(body: str) -> list[str]:
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"[{body}] holds {part!r}, not a number or a range like 01-04")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {part!r} runs backwards")
        numbers.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return numbers
