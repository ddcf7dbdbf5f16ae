"""torchft in this process: whether it is installed and loads, and its logs and warnings kept quiet.

torchft is optional (`pip install 'torchfleet[ft]'`): `unavailable()` says
why it cannot run here, and the launcher refuses `--fault-tolerance step`
(train, diloco and localsgd) with that sentence before any process starts.
`quiet()` and `skip_noop_calls()` keep torchft's own logging and a warning
torch 2.14 prints on its behalf out of a run's output.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import warnings

INSTALL = "pip install 'torchfleet[ft]' (or pip install torchft)"


def quiet() -> None:
    """torchft's Rust side logs every quorum and commit at INFO on stderr, and its Python side logs each
    failed collective with a traceback; torchfleet says what happened in one line instead. RUST_LOG must be
    set before torchft's extension is loaded. TORCHFLEET_VERBOSE=1 keeps them."""
    if os.environ.get("TORCHFLEET_VERBOSE"):
        return
    os.environ.setdefault("RUST_LOG", "error")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchft's transport wraps its pickled header with torch.frombuffer, which warns once about a
    # read-only buffer it only reads: noise in every healing group's output.
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def skip_noop_calls() -> None:
    """torchft 0.2 calls `_set_sequence_number_for_group()` on the Gloo group of every quorum. From torch 2.14
    that call does nothing but print a deprecation warning from C++ (once a process, past Python's warning
    filters), which a user can do nothing about; torchfleet's groups skip the call there. Before 2.14 it sets
    the group's sequence number, and is kept."""
    from torchfleet.versions import release

    if release() < (2, 14) or os.environ.get("TORCHFLEET_VERBOSE"):
        return
    import torchft.process_group
    from torch.distributed import ProcessGroupGloo

    if torchft.process_group.BaseProcessGroupGloo is not ProcessGroupGloo:
        return  # done already, or a torchft that builds its groups otherwise

    class Gloo(ProcessGroupGloo):  # type: ignore[misc]
        def _set_sequence_number_for_group(self) -> None:
            """A no-op in torch 2.14 and later, as torch's own, without its warning."""

    torchft.process_group.BaseProcessGroupGloo = Gloo  # type: ignore[misc]


def version() -> str | None:
    """The installed torchft's version, or None when it is not installed."""
    if importlib.util.find_spec("torchft") is None:
        return None
    try:
        return importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def unavailable() -> str | None:
    """Why torchft cannot run here (one clause), or None when it can."""
    found = version()
    if found is None:
        return f"torchft is not installed; {INSTALL}"
    quiet()
    try:
        import torchft  # noqa: F401 - the import is the check: its extension and its torch must load
        from torchft._torchft import LighthouseServer  # noqa: F401
    except Exception as exc:  # an ImportError, or an extension built for another torch
        import torch

        return (
            f"torchft {found} does not load with torch {torch.__version__} ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no message'}); install a torchft"
            " release built for this torch"
        )
    return None
