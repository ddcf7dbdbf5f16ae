"""Rank 1 dies by SIGABRT, as a Gloo abort in torch's teardown does; rank 0 ends normally.

abort_at_exit.py after    rank 1 runs the script to its end, then aborts at exit (atexit)
abort_at_exit.py during   rank 1 aborts in the middle of the script
"""

import atexit
import os
import resource
import signal
import sys

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort writes no core file into the tree
abort = lambda: os.kill(os.getpid(), signal.SIGABRT)  # noqa: E731
if os.environ["RANK"] == "1":
    if sys.argv[1] == "after":
        atexit.register(abort)
    else:
        abort()
print("rank", os.environ["RANK"], "reached the end of the script")
