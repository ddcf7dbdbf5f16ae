"""Rank 1 fails in a way chosen by argv[1]; rank 0 waits in a collective meanwhile."""

import os
import signal
import sys
import time

import torchfleet

fleet = torchfleet.Fleet(strategy="ddp")
how = sys.argv[1]
if fleet.rank == 1:
    if how == "raise":
        raise ValueError("boom on purpose")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit":
        sys.exit(3)
else:
    fleet.barrier()  # would wait forever for rank 1: the launcher must stop it
    time.sleep(60)
