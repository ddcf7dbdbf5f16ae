"""Worker entry for `torchfleet run script.py` (or `-m module`): run it as __main__.

Exceptions are recorded for the launcher's failure summary (see failures.py),
so user scripts need no ``@record`` decorator; a script that ran to its end is
recorded too, so a rank that dies afterwards, in teardown, is told apart.
"""

import os
import runpy
import sys

from torchfleet.launcher.failures import call_recorded, record_finished


def line_buffered() -> None:
    """Make stdout and stderr write each whole line at once, as soon as it ends.

    The ranks share one terminal or pipe. Unbuffered (`python -u`, PYTHONUNBUFFERED)
    a print is several writes (each argument, each separator, the newline), so two
    ranks' lines cut into each other ("rankrank  10"); block-buffered, as Python
    writes to a pipe by default, output waits and is cut every 8 KiB, mid-line.
    Line-buffered, each line is one write, and one write of up to 4 KiB to a pipe
    is never mixed with another process's.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # TextIO's type has none; a stream may be None
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def main() -> None:
    line_buffered()
    if sys.argv[1] == "-m":  # `torchfleet run -m package.module`, as `python -m` runs it
        module, *args = sys.argv[2:]
        sys.argv = [module, *args]
        sys.path.insert(0, os.getcwd())
        run, target, extra = runpy.run_module, module, (None, "__main__", True)
    else:
        script, *args = sys.argv[1:]
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
        run, target, extra = runpy.run_path, script, (None, "__main__")
    try:
        call_recorded(run, target, *extra)
    except SystemExit as exc:
        if exc.code in (None, 0):  # sys.exit() or sys.exit(0): the script ended as it meant to
            record_finished()
        raise
    record_finished()


if __name__ == "__main__":
    main()
