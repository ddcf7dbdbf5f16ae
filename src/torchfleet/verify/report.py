"""`torchfleet verify`'s table: a row a strategy, its largest weight difference from serial, verdict, time."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from torchfleet.verify.run import Verdict


def table(verdict: Verdict) -> str:
    lines = [
        f"torchfleet verify: {verdict.source}, {verdict.steps} SGD steps, {verdict.processes} processes",
        f"serial: {verdict.serial_seconds:.1f} s; serial with every linear layer summed in two halves is"
        f" {verdict.floor:.2g} from it (float order alone), so equal means within {verdict.bound:.2g}",
        "",
        f"{'strategy':<16} {'max |w - serial|':>16}  {'verdict':<8} {'time':>7}",
    ]
    for row in verdict.rows:
        difference = "-" if row.difference is None else f"{row.difference:.2g}"
        seconds = "-" if row.seconds is None else f"{row.seconds:.1f} s"
        lines.append(f"{row.strategy:<16} {difference:>16}  {row.verdict:<8} {seconds:>7}")
        if row.reason:
            lines.append(f"{'':<16} {row.reason}")
    differs = verdict.differs
    lines.append("")
    if differs:
        lines.append(
            f"{', '.join(differs)} {'does' if len(differs) == 1 else 'do'} not train this model to serial's weights"
            " (beyond float order, or at all): a defect of the strategy or of how it cut or split this model"
        )
    else:
        lines.append("every strategy that ran trains this model to serial's weights")
    return "\n".join(lines)


def write_json(verdict: Verdict, path: str) -> None:
    Path(path).write_text(json.dumps(asdict(verdict), indent=2) + "\n")
