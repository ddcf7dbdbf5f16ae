"""Files scikit-learn ships, found without importing scikit-learn.

The built-in data sets (digits, and the text corpus of its data sets'
descriptions) are files inside the installed package. Importing
`sklearn.datasets` to reach them costs about 1.5 s of a core (it pulls in
SciPy), and every worker of a job paid that before its first step; reading
the files where the package's import system says they are costs
milliseconds. scikit-learn must still be installed: a dependency of
torchfleet's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torchfleet.errors import UsageError


def sklearn_path(*parts: str) -> Path:
    """The path of a file or folder inside the installed scikit-learn package."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "scikit-learn is not installed; the built-in data sets are files inside it (pip install scikit-learn)"
        )
    return Path(next(iter(spec.submodule_search_locations)), *parts)
