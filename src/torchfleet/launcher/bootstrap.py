"""Worker entry for `torchfleet run script.py` (or `-m module`): run it as __main__.

Exceptions are recorded for the launcher's failure summary (see failures.py),
so user scripts need no ``@record`` decorator.
"""

import os
import runpy
import sys

from torchfleet.launcher.failures import call_recorded


def main() -> None:
    if sys.argv[1] == "-m":  # `torchfleet run -m package.module`, as `python -m` runs it
        module, *args = sys.argv[2:]
        sys.argv = [module, *args]
        sys.path.insert(0, os.getcwd())
        call_recorded(runpy.run_module, module, None, "__main__", True)
        return
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
    call_recorded(runpy.run_path, script, None, "__main__")


if __name__ == "__main__":
    main()
