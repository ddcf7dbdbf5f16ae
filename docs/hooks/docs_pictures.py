"""The site's pictures, drawn at build time from what torchfleet itself computes or wrote.

mesh.png: which rank holds which piece, from ParallelDims (the degrees `--strategy` resolves to).
schedules.png: the order of each `--schedule`'s actions on two processes, from the torch class
torchfleet runs for it (torch's own schedule simulator lays the actions out in time).
bench.png and plan.png: bench's and plan's own chart functions over results those commands
wrote (docs/data/*.json, each with its date and machine).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
# Colours by role: forward, whole backward, the input's gradient, the weights' gradient (zero bubble).
KINDS = {
    "F": ("#4c72b0", "forward"),
    "B": ("#dd8452", "backward"),
    "I": ("#c44e52", "backward (input)"),
    "W": ("#8172b3", "backward (weights)"),
}


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def mesh() -> bytes:
    from torchfleet.strategies.dims import ParallelDims

    layouts = [
        ("hsdp", ParallelDims.from_preset("hsdp", 8, nodes=2), "on 2 machines of 4"),
        ("fsdp+pipeline", ParallelDims.from_preset("fsdp+pipeline", 8), ""),
        ("fsdp+tp", ParallelDims.from_preset("fsdp+tp", 8), ""),
    ]
    fig, axes = plt.subplots(1, len(layouts), figsize=(13, 3.6))
    palette = plt.get_cmap("tab10")
    for ax, (word, dims, where) in zip(axes, layouts, strict=True):
        model_slots = dims.pp * dims.tp  # the pieces one data-parallel rank's model is cut into
        for rank in range(dims.world_size):
            c = dims.coords(rank)
            x = c["dp_shard"] * model_slots + c["pp"] * dims.tp + c["tp"]
            y = dims.dp_replicate - 1 - c["dp_replicate"]
            slot = c["pp"] if dims.pp > 1 else c["tp"]
            ax.add_patch(
                plt.Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=palette(slot), alpha=0.35, edgecolor="black")
            )
            parts = [f"shard {c['dp_shard']}"] if dims.dp_shard > 1 else []
            parts += [f"replica {c['dp_replicate']}"] if dims.dp_replicate > 1 else []
            parts += [f"stage {c['pp']}"] if dims.pp > 1 else []
            parts += [f"tp {c['tp']}"] if dims.tp > 1 else []
            ax.text(x + 0.5, y + 0.5, f"rank {rank}\n" + "\n".join(parts), ha="center", va="center", fontsize=8)
        ax.set_xlim(0, dims.dp_shard * model_slots)
        ax.set_ylim(0, dims.dp_replicate)
        ax.set_axis_off()
        ax.set_title(f"--strategy {word} -n 8 {where}\n{dims.arithmetic()}", fontsize=9)
    fig.suptitle("Which rank holds which piece (colour: the model piece; a row: one replica)", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _kind(action) -> str:
    return {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(
        str(action.computation_type).split(".")[-1], ""
    )


def _one_stage_order(name: str, first: list, pp: int, microbatches: int) -> list[list]:
    """gpipe's and 1f1b's order on every process.

    torch runs these two from the stage's own rank at step time (_step_microbatches), and the
    simulator, which builds one stand-in stage, gets only process 0's order right. So the other
    processes follow torch's rule (1f1b: pp - rank forwards, then a backward and a forward in
    turn), checked here against process 0's order from torch.
    """
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    def order(rank: int) -> list:
        forward = [_Action(rank, _ComputationType.FORWARD, m) for m in range(microbatches)]
        backward = [_Action(rank, _ComputationType.FULL_BACKWARD, m) for m in range(microbatches)]
        if name == "gpipe":
            return forward + backward
        warm = min(microbatches, pp - rank)
        steady = [a for pair in zip(backward, forward[warm:], strict=False) for a in pair]
        return forward[:warm] + steady + backward[len(forward) - warm :]

    mine = [(_kind(a), a.microbatch_index) for a in order(0)]
    if mine != [(_kind(a), a.microbatch_index) for a in first]:
        raise SystemExit(f"docs: {name}'s order on process 0 is not torch's: {mine}")
    return [order(rank) for rank in range(pp)]


def _schedule_actions(name: str, pp: int, microbatches: int) -> list[list]:
    """Per process, its compute actions in time (None where it waits for a neighbour).

    The order on each process is the one the torch class torchfleet runs for `name` produces;
    the waits follow from the data each action needs: a forward, the previous stage's forward
    of that micro-batch; a backward, the next stage's backward; the weights' gradient, the
    input's. Every action takes one slot.
    """
    from torch.distributed.pipelining import _schedule_visualizer as simulator

    from torchfleet.strategies.pipeline.schedules import SCHEDULES, schedule_class

    per = SCHEDULES[name][1] or 2
    with contextlib.redirect_stdout(io.StringIO()):  # the simulator prints every step it takes
        ops = simulator.get_schedule_ops(schedule_class(name), pp, microbatches, per)
    queues = [[a for a in rank if a is not None and _kind(a)] for rank in ops]
    if per == 1:  # see _one_stage_order
        queues = _one_stage_order(name, queues[0], pp, microbatches)
    last = max(a.stage_index for rank in queues for a in rank)
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> the slot it ended in

    def ready(a, now: int) -> bool:
        kind, s, m = _kind(a), a.stage_index, a.microbatch_index
        needs = {
            "F": [("F", s - 1, m)] if s else [],
            "B": [("F", s, m)] + ([("B", s + 1, m), ("I", s + 1, m)] if s < last else []),
            "W": [("I", s, m)],
        }
        needs["I"] = needs["B"]
        wanted = needs[kind]
        if kind in ("B", "I") and s < last:  # the next stage's gradient, whole or the input's part
            return done.get(("F", s, m), now) < now and any(done.get(k, now) < now for k in wanted[1:])
        return all(done.get(k, now) < now for k in wanted)

    timeline: list[list] = [[] for _ in queues]
    heads, now = [0] * len(queues), 0
    while any(h < len(q) for h, q in zip(heads, queues, strict=True)):
        moved = False
        for rank, queue in enumerate(queues):
            action = queue[heads[rank]] if heads[rank] < len(queue) else None
            if action is not None and ready(action, now):
                done[(_kind(action), action.stage_index, action.microbatch_index)] = now
                heads[rank] += 1
                moved = True
            timeline[rank].append(
                action
                if action is not None and done.get((_kind(action), action.stage_index, action.microbatch_index)) == now
                else None
            )
        if not moved:
            raise SystemExit(f"docs: the {name} schedule's actions wait on each other at slot {now}")
        now += 1
    return timeline


def schedules() -> bytes:
    from torchfleet.strategies.pipeline.schedules import available

    names = available()
    pp, microbatches = 2, 4
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.25 * len(names) + 0.8))
    for ax, name in zip(axes, names, strict=True):
        timeline = _schedule_actions(name, pp, microbatches)
        for rank, actions in enumerate(timeline):
            for t, action in enumerate(actions):
                if action is None:
                    continue
                kind = _kind(action)
                ax.add_patch(plt.Rectangle((t, pp - 1 - rank + 0.1), 0.95, 0.8, facecolor=KINDS[kind][0], alpha=0.85))
                ax.text(
                    t + 0.47,
                    pp - 1 - rank + 0.5,
                    f"{action.microbatch_index}\ns{action.stage_index}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
        ax.set_xlim(0, max(len(a) for a in timeline))
        ax.set_ylim(0, pp)
        ax.set_yticks([pp - 1 - r + 0.5 for r in range(pp)], [f"process {r}" for r in range(pp)], fontsize=7)
        ax.set_xticks([])
        ax.set_title(
            f"--schedule {name}: {sum(a is not None for r in timeline for a in r)} actions over"
            f" {max(len(a) for a in timeline)} slots",
            fontsize=8,
            loc="left",
        )
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c) for c, _ in KINDS.values()]
    fig.legend(handles, [label for _, label in KINDS.values()], loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(
        f"Pipeline schedules on {pp} processes, {microbatches} micro-batches (a box: micro-batch, stage"
        "; time runs right)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _png(fig)


def _through_file(draw) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chart.png"
        written = draw(path)
        if str(written) != str(path):
            raise SystemExit(f"docs: no chart drawn: {written}")
        return path.read_bytes()


def bench() -> bytes:
    from torchfleet.bench import chart, report

    document = json.loads((DATA / "bench.json").read_text())
    return _through_file(lambda path: chart.draw(document["cells"], path, title=report.chart_title(document)))


def plan() -> bytes:
    from torchfleet.plan import report

    document = json.loads((DATA / "plan.json").read_text())
    return _through_file(lambda path: report.chart(document, str(path)))


PICTURES = {
    "images/mesh.png": mesh,
    "images/schedules.png": schedules,
    "images/bench.png": bench,
    "images/plan.png": plan,
}
