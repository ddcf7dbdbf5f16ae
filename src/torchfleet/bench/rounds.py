"""bench's cells measured in interleaved rounds: each round runs every cell once, in fresh processes.

A burst of load that comes and goes then lands on every cell alike, not on the one cell that happened to
run at the time; one cell after another, a run beside another job once measured serial at 238 ms a step
and, minutes later, at 0.69 ms. The order turns by one cell each round, so no cell always runs after the
same one.

Each round times at least `--steps` steps, and as many as take `--round-time` seconds at their median
(measure_cell.round_steps), so a short step gets hundreds and a long one the least; `round_steps` says how
many each round ran. A cell's rounds make its one row: its median step time and quartiles are the medians
of the rounds' (each round counts once, however many steps it ran), its extremes those of all its steps,
and its `spread` the rounds' range over their median (from TRIMMED_FROM rounds on without the one
farthest from the median; with one round, the steps' interquartile range over their median); `others_cores` is the most any of its rounds saw (machine_load.py). A cell that fails in a
round is not run again: its row is that failure.
"""

from __future__ import annotations

import statistics

from torchfleet.bench.cells import Cell
from torchfleet.bench.config import MAX_ROUND_STEPS, BenchConfig
from torchfleet.bench.launch_cell import run_one
from torchfleet.bench.measure_cell import spread as step_spread

# From this many rounds on, a cell's spread leaves out its one round farthest from the median. On an idle
# machine a fresh process now and then runs a short step a third slower for its whole life (where its memory
# and threads landed); with 3 rounds that one process is a third of the evidence and the range must show it,
# with 5 it is one outlier among agreeing rounds, and the median it cannot move is the cell's figure.
TRIMMED_FROM = 5


def round_spread(medians: list[float]) -> float:
    """The rounds' range over their median, the round farthest from the median left out (TRIMMED_FROM rounds
    or more; fewer: the whole range)."""
    kept = _kept(medians)
    return (max(kept) - min(kept)) / statistics.median(medians)


def _kept(medians: list[float]) -> list[float]:
    """The rounds a cell's spread and range are taken over (round_spread says which)."""
    if len(medians) < TRIMMED_FROM:
        return list(medians)
    middle = statistics.median(medians)
    return sorted(medians, key=lambda m: abs(m - middle))[:-1]


def run(cells: list[Cell], cfg: BenchConfig, bar) -> list[dict]:
    """Every cell's row, each from `cfg.rounds` rounds; `bar` hears of each cell as it starts and ends."""
    measured: list[list[dict]] = [[] for _ in cells]
    for r in range(cfg.rounds):
        for k in range(len(cells)):
            i = (k + r) % len(cells)
            if r and (cells[i].skip or measured[i][-1]["status"] != "ok"):
                continue  # a skipped cell is one row; a failed one would only fail again
            bar.start(cells[i], r, cfg.rounds)
            measured[i].append(run_one(cells[i], cfg, profile=r == cfg.rounds - 1))
            bar.step()
    return [merge(rows, cfg.rounds) for rows in measured]


def sizing(config: dict) -> str:
    """How long each cell's rounds are, in words, from results.json's `config` (BenchConfig's fields): the
    run's first lines and the table's caption say it."""
    rounds, steps, budget = config.get("rounds", 1), config["steps"], config.get("round_time_s") or 0
    if not budget:
        return f"{rounds} rounds of {steps} timed steps a cell"
    return (
        f"{rounds} rounds a cell, each timing at least {steps} steps and as many as take {budget:g} s at their"
        f" median (at most {MAX_ROUND_STEPS})"
    )


def runs(cells: list[Cell], cfg: BenchConfig) -> int:
    """How many cell runs `run` will make at most (the progress bar's total)."""
    return sum(1 if c.skip else cfg.rounds for c in cells)


def merge(rows: list[dict], rounds: int) -> dict:
    """One cell's rounds as one row (the module says how)."""
    last = rows[-1]
    if last["status"] != "ok":
        where = f"in round {len(rows)} of {rounds}: " if len(rows) > 1 else ""
        return {**last, "error": where + last["error"], "rounds": len(rows)}
    medians = [r["step_time_median_s"] for r in rows]
    steps = [t for r in rows for t in r["step_times_s"]]
    # Rounds of unequal length count alike: a round of 700 short steps must not outweigh one of 6 long ones.
    merged = {
        **last,
        **step_spread(steps),
        "step_time_median_s": statistics.median(medians),
        "step_time_q1_s": statistics.median(r["step_time_q1_s"] for r in rows),
        "step_time_q3_s": statistics.median(r["step_time_q3_s"] for r in rows),
    }
    median = merged["step_time_median_s"]
    if len(rows) > 1:
        merged["spread"] = round_spread(medians)
    else:
        merged["spread"] = (merged["step_time_q3_s"] - merged["step_time_q1_s"]) / median
    others = [r["others_cores"] for r in rows if r.get("others_cores") is not None]
    shares = [r["comm_share"] for r in rows if r.get("comm_share") is not None]
    merged.update(
        rounds=len(rows),
        round_step_time_s=medians,
        round_steps=[r["timed_steps"] for r in rows],
        others_cores=max(others) if others else None,
        comm_share=statistics.median(shares) if shares else None,
        first_step_s=rows[0].get("first_step_s"),
        wall_s=sum(r["wall_s"] for r in rows),
        notes=list(dict.fromkeys(n for r in rows for n in r.get("notes") or ())),
    )
    merged.pop("step_times_s")
    merged.pop("timed_steps")
    return merged


def rate_range(row: dict) -> tuple[float, float]:
    """The cell's slowest and fastest rate in samples/s: of its rounds, or with one round of its steps'
    quartiles; what the verdict compares (a lead counts when it clears this range)."""
    batch = row["global_batch"]
    if row.get("rounds", 1) > 1:
        kept = _kept(row["round_step_time_s"])
        return batch / max(kept), batch / min(kept)
    return batch / row["step_time_q3_s"], batch / row["step_time_q1_s"]
