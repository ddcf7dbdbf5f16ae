"""torchfleet's own version, as its installed metadata gives it. No torch here: `--version` reads it.

Read on first use, not at import: finding the metadata scans sys.path, which
every worker of `torchfleet run` would otherwise pay before the user's script starts.
"""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("torchfleet")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"
