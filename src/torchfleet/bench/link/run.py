"""bench's link mode, the whole command on one machine (every machine runs it; see __init__.py).

1. the preflight (launcher/preflight.py): route, master port, versions, a first all-reduce; node 0's
   store stays open until the end, the others join it;
2. node 0 sends its plan; the others run it (and say where their own flags differed);
3. the link's Mbit/s (measure.py), printed on every machine;
4. each cell: every machine ready, then its `torchfleet run` (cell_process.py); each posts what it measured,
   node 0 combines the posts into a row and prints it;
5. node 0: the table, the verdict, results.json in --out; the others print the verdict too.

Every machine writes its cells' logs to --out/logs (cell-NAME-nodeR.log, and the worker's JSON beside).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

from torchfleet.bench.link import cell_process as link_cells
from torchfleet.bench.link import report
from torchfleet.bench.link.job import LinkJob, Machines
from torchfleet.bench.link.measure import measure
from torchfleet.bench.link.meeting import Meeting
from torchfleet.launcher import preflight

# How long a machine waits for the others between cells: one may still be finishing a cell that ran
# to its deadline, or stopping one that did.
SLACK_SECONDS = 120.0


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _exposure(machines: Machines, cells: int) -> str:
    if machines.node_rank:
        return (
            f"torchfleet bench: node {machines.node_rank} joins node 0 at {machines.master_addr} ports"
            f" {machines.master_port} to {machines.master_port + cells} (docs/guides/security.md)"
        )
    return (
        f"torchfleet bench: node 0 opens ports {machines.master_port} to {machines.master_port + cells} on every"
        " interface (the bench's store and each cell's rendezvous or lighthouse; TCP, no authentication) and"
        " Gloo ports the OS chooses: run it on a private network (docs/guides/security.md)"
    )


def _differences(mine: LinkJob, theirs: LinkJob) -> list[str]:
    return [
        f"{name} {value!r} (here {getattr(mine, name)!r})"
        for name, value in asdict(theirs).items()
        if getattr(mine, name) != value
    ]


def run_link_bench(
    plan: LinkJob,
    machines: Machines,
    out: str,
    threads: int | None = None,
    notes: list[str] | None = None,
    console=None,
) -> dict:
    """Run link mode on this machine. Node 0 returns the results document; the others {"node", "verdict",
    "cells"}, their cells' statuses as they saw them (node 0 holds the figures)."""
    from rich.console import Console

    from torchfleet.outputs import check_writable_dir

    console = console or Console(width=None if Console().is_terminal else 132)

    def say(text: str) -> None:
        console.print(text, markup=False)  # brackets in a sentence are text, not styles

    node, nodes = machines.node_rank, machines.nnodes
    folder = check_writable_dir(out, what="--out")
    logs = check_writable_dir(folder / "logs", what="--out")
    # Gloo binds and advertises the interface that routes to the master, for the link's all-reduces here and
    # in the cells (the launcher sets the same for its workers): never the host name's 127.0.0.1.
    os.environ.update(preflight.route_env(node, machines.master_addr))
    checked = preflight.run(machines.master_addr, machines.master_port, node, nodes)
    say(f"torchfleet: {checked.sentence(node)}")
    print(_exposure(machines, len(plan.cells)), file=sys.stderr, flush=True)
    store = checked.store if node == 0 else _join(machines)
    meeting = Meeting(store, node, nodes)
    if node == 0:
        meeting.send_plan(asdict(plan))
    else:
        sent = meeting.receive_plan(SLACK_SECONDS)
        theirs = LinkJob(**{**sent, "cells": tuple(sent["cells"])})
        differ = _differences(plan, theirs)
        if differ:
            say(f"note: node 0's plan is the one run: {'; '.join(differ)}")
            notes = []  # this machine's notes are about its own plan, which is not run
        plan = theirs
    notes = list(notes or [])
    for note in notes:
        say(f"note: {note}")
    link = measure(store, node, nodes, checked.interface)
    say(f"link: {link.sentence()}" if node == 0 else f"link, as node {node} timed it: {link.sentence()}")

    threads = threads or _usable_cores()  # one process per machine: all of this machine's cores
    rows: list[dict] = []
    own: list[dict] = []  # this machine's part of each cell
    between = plan.cell_timeout_s + link_cells.STOP_SECONDS + SLACK_SECONDS
    for index, cell in enumerate(plan.cells):
        meeting.together(f"cell{index}", between)
        mine = link_cells.run_here(cell, index, plan, machines, threads, logs / f"cell-{cell}-node{node}.log")
        meeting.post(f"cell{index}", mine)
        own.append({"cell": cell, "status": mine["status"], "error": mine.get("error")})
        if node:
            say(
                f"{plan.label(cell)}: done here (node 0 shows the figures)"
                if mine["status"] == "ok"
                else f"{plan.label(cell)}: failed here: {mine['error']}"
            )
            continue
        rows.append(report.combine(cell, plan, machines, meeting.gather(f"cell{index}", between)))
        report.derive(rows)
        say(report.line(rows[-1]))
    if node:
        verdict = meeting.verdict(SLACK_SECONDS)
        say(f"verdict: {verdict}")
        return {"node": node, "verdict": verdict, "cells": own}
    from torchfleet.backend import probe_hardware
    from torchfleet.doctor import collect_report

    crowded = report.busy(rows)
    document = report.document(
        plan, machines, collect_report(probe_hardware()), link, rows, notes + ([crowded] if crowded else [])
    )
    report.write_json(document, folder / "results.json")
    console.print(report.table(document))
    if crowded:
        say(f"note: {crowded}")
    say(f"verdict: {document['verdict']}")
    say(f"wrote {folder / 'results.json'} (each machine's cell logs in its {logs})")
    meeting.goodbye(document["verdict"])  # node 0's store closes after this: the others have read the verdict
    return document


def _join(machines: Machines):
    """A client of node 0's store, which the preflight opened and node 0 keeps for the whole bench."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        machines.master_addr, machines.master_port, is_master=False, timeout=datetime.timedelta(seconds=SLACK_SECONDS)
    )
