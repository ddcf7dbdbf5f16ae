"""Each rank prints one line, then waits (60 s at most) for the file named by argv[1]."""

import os
import sys
import time

print("rank", os.environ["RANK"], "started")
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
