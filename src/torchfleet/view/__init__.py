"""Watching a run per rank: the terminal's live table, the page `--dashboard` serves, `torchfleet report`.

Everything here takes plain rows, the dicts a run writes to --metrics-out
(rows.py says which kinds and fields), so the live view and the report of a
finished run read the same records and draw the same page. No torch: the
training loop hands rows over, it is not imported.
"""

from __future__ import annotations

import importlib.util

from torchfleet.errors import UsageError

# The page's two libraries, an extra (`pip install 'torchfleet[dashboard]'`): the terminal table needs neither.
NEEDS = ("plotly", "bottle")


def check_installed(what: str) -> None:
    """Say, before any work, which of the page's libraries is missing and how to get it."""
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"{what} needs {' and '.join(missing)}, not installed here; run `pip install 'torchfleet[dashboard]'`"
        )
