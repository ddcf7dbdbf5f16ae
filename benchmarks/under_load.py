"""The fault-tolerance and elastic tests, run again and again beside a CPU load: do they hold on a busy machine?

    python benchmarks/under_load.py                   # 10 rounds beside stress-ng --cpu 4 (load average about 5-6)
    python benchmarks/under_load.py --rounds 3 --workers 6 --tests tests/replica_groups/test_ft.py

CI machines are shared: a test that times a pause, waits for a heartbeat or races a restart against its peers
must still pass when the cores are busy with other work. Each round runs pytest over the tests
(TORCHFLEET_REQUIRE_SYSTEM_TESTS=1: a test missing root, namespaces or torchft fails instead of skipping)
while `stress-ng --cpu N` keeps N workers busy; the 1-minute load average is sampled every 5 s. One line a
round (passed, failed, skipped, seconds, the load's median and maximum), then the totals. Stops at the first
failing round unless --keep-going, printing pytest's summary of what failed. Needs stress-ng (Debian's package
of that name). Minutes a round: about twice the tests' own time on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The tests whose claims involve time: killed, hung and lost ranks and hosts, restarts, healing, lighthouses,
# and the preflight's verdicts on many hosts (it failed CI once when a second torch lane ran beside it).
FAULT_TESTS = [
    "tests/replica_groups/test_ft.py",
    "tests/replica_groups/test_ft_hosts.py",
    "tests/launcher/test_elastic.py",
    "tests/train/test_faults.py",
    "tests/replica_groups/test_diloco.py::test_a_group_killed_between_meetings_heals_at_the_next_and_the_other_never_waits_long",
    "tests/launcher/test_multinode.py::test_preflight_names_the_node_and_the_cause_in_seconds",
]


class LoadSampler(threading.Thread):
    """The 1-minute load average every `every` seconds until stopped."""

    def __init__(self, every: float = 5.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.stopped = every, [], threading.Event()

    def run(self):
        while not self.stopped.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> list[float]:
        self.stopped.set()
        self.join()
        return self.samples


def one_round(tests: list[str], python: str) -> tuple[int, int, int, float, str]:
    """(passed, failed, skipped, seconds, pytest's summary lines) of one pytest run over `tests`."""
    env = {**os.environ, "TORCHFLEET_REQUIRE_SYSTEM_TESTS": "1"}
    start = time.time()
    done = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.time() - start
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", tail))
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|errors?)", tail))
    skipped = sum(int(n) for n in re.findall(r"(\d+) skipped", tail))
    if done.returncode != 0 and failed == 0:
        failed = 1  # pytest itself failed (collection, a crash): count it
    summary = "\n".join(line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR")))
    return passed, failed, skipped, seconds, summary or tail


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--workers", type=int, default=4, help="stress-ng CPU workers (default 4: a load of about 5-6 on 2 cores)"
    )
    parser.add_argument(
        "--tests", nargs="+", default=FAULT_TESTS, help="pytest paths (default: the fault-tolerance and elastic tests)"
    )
    parser.add_argument("--keep-going", action="store_true", help="run every round even after one failed")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with torchfleet and pytest")
    args = parser.parse_args()
    if shutil.which("stress-ng") is None:
        print("under_load: stress-ng is not installed (apt-get install stress-ng)", file=sys.stderr)
        return 2
    load = subprocess.Popen(["stress-ng", "--cpu", str(args.workers), "--cpu-load", "100", "--quiet"])
    time.sleep(30)  # let the load average climb before the first round
    totals = {"passed": 0, "failed": 0, "rounds": 0}
    every_sample = []
    try:
        for n in range(1, args.rounds + 1):
            sampler = LoadSampler()
            sampler.start()
            passed, failed, skipped, seconds, summary = one_round(args.tests, args.python)
            samples = sampler.stop() or [os.getloadavg()[0]]
            every_sample += samples
            totals["passed"] += passed
            totals["failed"] += failed
            totals["rounds"] += 1
            print(
                f"round {n}: {passed} passed, {failed} failed, {skipped} skipped in {seconds:.0f} s; load average median "
                f"{statistics.median(samples):.2f}, max {max(samples):.2f}",
                flush=True,
            )
            if failed:
                print(summary, flush=True)
                if not args.keep_going:
                    break
    finally:
        load.terminate()
        load.wait()
    print(
        f"{totals['rounds']} rounds: {totals['passed']} passed, {totals['failed']} failed; load average over all "
        f"rounds median {statistics.median(every_sample):.2f}, min {min(every_sample):.2f}, "
        f"max {max(every_sample):.2f}"
    )
    return 1 if totals["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
