"""Which bench figures hold, and the verdict they allow.

A cell is flagged, and left out of the verdict, when its figure cannot be the strategy's own:
- `bound`: its speedup over serial is above what its resources allow. Every cell gets the same cores and the
  same thread budget (processes x threads per process; cells.py), so P processes can beat one process at most
  P times over, on CPU only as far as there are cores for them (min(P, cores)), on GPUs one device each (dp
  and mp: the GPUs here). BOUND_SLACK leaves room for what a smaller batch per process gains in cache. A run
  beside another job once read 262x serial for one process on 2 cores: serial's 2 threads had waited for
  the other job's, a wait the single-threaded cells never make.
- `baseline`: serial, where some cell of its batch and precision is flagged `bound`: its figure is the
  suspect one, so it names nothing either.
- `spread`: its rounds disagree by more than SPREAD_LIMIT of their median (rounds.py).
A cell measured while other processes kept busy_cores() or more of the cores busy is flagged `busy`: it
stays in the verdict, which then says it is uncertain and why, with the figure.

The fastest cell is named only when its slowest round is faster than every other cell's fastest
(rounds.rate_range): a lead inside the rounds' spread is noise. Otherwise the verdict names the cells it
cannot tell apart, why, and what to do. A cell left out for its spread alone still counts by its rounds:
one whose slowest beats every other cell's fastest is named (the spread said), and one whose fastest
reaches the best held cell's slowest leaves no verdict: an idle 2-core machine once had serial flagged for
spread at 0.39 ms a step and named ddp, at 1.98 ms, the fastest.
"""

from __future__ import annotations

from torchfleet.bench.rounds import rate_range
from torchfleet.machine_load import busy_cores
from torchfleet.models import IMAGE_MODELS, TOKEN_MODELS
from torchfleet.strategies import registry

BOUND_SLACK = 1.5
SPREAD_LIMIT = 0.25
FLAGS = ("bound", "baseline", "spread", "busy")
LEFT_OUT = ("bound", "baseline", "spread")  # busy stays in, and makes the verdict uncertain


def label(row: dict) -> str:
    name = row["strategy"]
    return name if row["processes"] == 1 else f"{name} on {row['processes']} processes"


def throughput_unit(model: str) -> str:
    """Throughput's unit for a model: tokens/s for gpt (a sample is a sequence), images/s for the ResNets."""
    return "tokens/s" if model in TOKEN_MODELS else "images/s" if model in IMAGE_MODELS else "samples/s"


def throughput(row: dict) -> str:
    """A cell's rate with its unit, as the tables and the cell lines show it (bench's link mode too)."""
    if row.get("tokens_per_s") is not None:
        return f"{row['tokens_per_s']:,.0f} tokens/s"
    return f"{row['samples_per_s']:,.0f} {throughput_unit(row.get('model', ''))}"


def comm(row: dict) -> str:
    share = row.get("comm_share")
    return "" if share is None else f" (communication is {share:.0%} of the step)"


def speedup_bound(row: dict, cores: int, gpus: int) -> int:
    """The most `row`'s cell can beat serial by, from its processes and the cores or GPUs they use."""
    if str(row.get("device", "cpu")).startswith("cuda"):
        return max(1, gpus) if registry.spans_devices(row["strategy"]) else row["processes"]
    return max(1, min(row["processes"], cores))


def flag(rows: list[dict], cores: int, gpus: int) -> None:
    """Fill each row's `flags` (FLAGS' names) and `flag_reasons` (a sentence each) in place."""
    for r in rows:
        r["flags"], r["flag_reasons"] = [], []
    ok = [r for r in rows if r["status"] == "ok"]
    doubted = set()
    for r in ok:
        bound = speedup_bound(r, cores, gpus)
        if r["strategy"] != registry.REFERENCE and r["speedup"] is not None and r["speedup"] > bound * BOUND_SLACK:
            doubted.add((r["global_batch"], r["precision"]))
            uses = "processes" if r["processes"] > 1 else "process"
            _add(
                r,
                "bound",
                f"{r['speedup']:.2f}x serial is more than {r['processes']} {uses} on {cores} cores can reach"
                f" ({bound}x, {bound * BOUND_SLACK:g}x with room for cache effects)",
            )
        if r["spread"] is not None and r["spread"] > SPREAD_LIMIT:
            across = "its rounds" if r.get("rounds", 1) > 1 else "its steps' quartiles"
            _add(r, "spread", f"{across} differ by {r['spread']:.0%} of the median, above the {SPREAD_LIMIT:.0%} limit")
        if r.get("others_cores") is not None and r["others_cores"] >= busy_cores(cores):
            _add(r, "busy", f"other processes kept {r['others_cores']:.1f} of {cores} cores busy while it ran")
    for r in ok:
        if r["strategy"] == registry.REFERENCE and (r["global_batch"], r["precision"]) in doubted:
            _add(r, "baseline", "cells of its batch beat it by more than their resources allow: its figure is in doubt")


def _add(row: dict, name: str, reason: str) -> None:
    row["flags"].append(name)
    row["flag_reasons"].append(f"{name}: {reason}")


def verdict(rows: list[dict], machine: dict | None = None) -> str:
    """The fastest cell, when the figures allow naming it; otherwise which cells cannot be told apart and why."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return "no cell ran, so there is no verdict; each row says why"
    trusted = [r for r in ok if not set(r.get("flags") or ()) & set(LEFT_OUT)]
    left_out = [r for r in ok if r not in trusted]
    out = _left_out_sentence(left_out)
    busy = _busy(ok, machine)
    # A cell left out for its spread alone still ran no faster than its fastest round and no slower than its
    # slowest: the noise of a busy core slows rounds, it does not speed them up (what would is flagged `bound`).
    spread_only = [r for r in left_out if set(r["flags"]) & set(LEFT_OUT) == {"spread"}]
    ahead = _ahead_of_all(spread_only, trusted + spread_only)
    if ahead is not None:
        text = _named(ahead, [*trusted, ahead])
        text += (
            f" Its rounds differ by {ahead['spread']:.0%}, but even its slowest was faster than every other cell's"
            " fastest."
        )
        return _uncertain(text, busy) + _left_out_sentence([r for r in left_out if r is not ahead])
    if not trusted or len(trusted) < 2 <= len(ok):  # one cell left has nothing to be the fastest against
        why = f"; {busy}" if busy else ""
        held = (
            f"only one cell's figure holds ({label(trusted[0])} at batch {trusted[0]['global_batch']})"
            if trusted
            else "every cell's figure is in doubt"
        )
        return f"no verdict: {held}{why}.{out} Rerun on an idle machine, or give more --rounds."
    best = max(trusted, key=lambda r: r["samples_per_s"])
    slowest_best = rate_range(best)[0]
    tied = [r for r in trusted if r is not best and rate_range(r)[1] >= slowest_best]
    shadowed = [r for r in spread_only if rate_range(r)[1] >= slowest_best]
    if shadowed:  # a cell left out may be the fastest: naming the best of those that hold would mislead
        why = f"; {busy}" if busy else ""
        return (
            f"no verdict: {label(best)} leads the cells whose figures hold ({_range(best)}), but cells left out"
            f" for their spread reached as far or further in some round ({_ranges(shadowed)}){why}.{out}"
            " Rerun on an idle machine, or give more --rounds."
        )
    return _uncertain(_tied(best, tied) if tied else _named(best, trusted), busy) + out


def _uncertain(text: str, busy: str) -> str:
    """The verdict `text`, said to be uncertain where the machine was `busy` (the reason; '' when idle)."""
    return f"uncertain, {busy}: {text[0].lower()}{text[1:]}" if busy else text


def _left_out_sentence(rows: list[dict]) -> str:
    return f" Left out, flagged: {'; '.join(_left_out(r) for r in rows)} (the table says why)." if rows else ""


def _ranges(rows: list[dict]) -> str:
    """Each cell with its batch and the range of its rounds' rates, as the verdicts list cells they cannot rank."""
    return ", ".join(f"{label(r)} at batch {r['global_batch']} {_range(r)}" for r in rows)


def _ahead_of_all(candidates: list[dict], others: list[dict]) -> dict | None:
    """The candidate whose slowest round beats every other cell's fastest (of `others`), if one does."""
    for r in candidates:
        rivals = [o for o in others if o is not r]
        if rivals and all(rate_range(r)[0] > rate_range(o)[1] for o in rivals):
            return r
    return None


def _busy(ok: list[dict], machine: dict | None) -> str:
    """Why the figures may be the machine's, not the strategies': '' on an idle machine."""
    cores = (machine or {}).get("cores")
    seen = [r["others_cores"] for r in ok if "busy" in (r.get("flags") or ())]
    if seen:
        return f"the machine was busy (other processes kept up to {max(seen):.1f} of {cores or '?'} cores busy)"
    if machine and machine.get("busy"):
        return f"the machine was busy at the start (other processes kept {machine['others_cores']:.1f} cores busy)"
    return ""


def _left_out(row: dict) -> str:
    return f"{label(row)} at batch {row['global_batch']} ({', '.join(f for f in row['flags'] if f in LEFT_OUT)})"


def _tied(best: dict, tied: list[dict]) -> str:
    cells = [best, *sorted(tied, key=lambda r: -r["samples_per_s"])]
    return (
        f"no fastest for {best['model']} here: {len(cells)} cells cannot be told apart, their rounds overlap"
        f" ({_ranges(cells)}). Rerun on an idle machine, or give more --rounds (or a longer --round-time) to narrow them."
    )


def _range(row: dict) -> str:
    low, high = rate_range(row)
    unit = throughput(row).split(" ", 1)[1]
    scale = row.get("tokens_per_sample") or 1
    return f"{low * scale:,.0f}-{high * scale:,.0f} {unit}"


def _named(best: dict, trusted: list[dict]) -> str:
    text = (
        f"{label(best)} is the fastest for {best['model']} here: "
        f"{throughput(best)} at batch {best['global_batch']} ({best['precision']})"
    )
    if best["strategy"] == registry.REFERENCE:
        rivals = [r for r in trusted if r["strategy"] != registry.REFERENCE and r["speedup"] is not None]
        if rivals:
            top = max(rivals, key=lambda r: r["speedup"])
            text += (
                f"; the best parallel cell, {label(top)} at batch {top['global_batch']},"
                f" reaches {top['speedup']:.2f}x serial{comm(top)}"
            )
        return text + "."
    if best["speedup"] is not None:
        text += f", {best['speedup']:.2f}x serial at the same batch{comm(best)}"
    # How the same set-up fares at the smallest other batch says why batch size matters.
    same = sorted(
        (
            r
            for r in trusted
            if r is not best
            and r["speedup"] is not None
            and (r["strategy"], r["processes"], r["precision"])
            == (best["strategy"], best["processes"], best["precision"])
        ),
        key=lambda r: r["global_batch"],
    )
    if same:
        small = same[0]
        text += f"; at batch {small['global_batch']} it is {small['speedup']:.2f}x serial{comm(small)}"
    return text + "."
