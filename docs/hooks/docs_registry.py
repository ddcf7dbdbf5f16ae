"""The words the Reference needs that the code does not hold as text.

docs_reference.py checks these against the source on every build: a TORCHFLEET_* variable the
source reads with no entry here, or an entry whose variable the source no longer reads,
stops the build; the exit codes' values are imported from the constants that produce them.
"""

from __future__ import annotations

# name -> (who sets it: "users", "launcher" for what torchfleet sets for its own workers, or "tests"; what it does)
VARIABLES: dict[str, tuple[str, str]] = {
    "TORCHFLEET_VERBOSE": (
        "users",
        "Any value keeps the log lines torchfleet otherwise silences: the elastic"
        " agent's own report of a failure it summarises, torch's c10d notes about client"
        " host names, torchft's start-up chatter.",
    ),
    "TORCHFLEET_MALLOC": (
        "users",
        "`default` leaves glibc's malloc thresholds alone; by default Fleet raises"
        " the mmap and trim thresholds on a CPU so that each step does not return and"
        " refault its tensors' pages.",
    ),
    "TORCHFLEET_MAP_WEIGHTS": (
        "users",
        "`0` reads every share of `fleet.setup(weights=DIR)` with `os.pread`; by default a share that is one"
        " run of a file's bytes, on the CPU, is a private copy-on-write mapping of the file instead.",
    ),
    "TORCHFLEET_RUN_ID": (
        "users",
        "The rendezvous id when `--rdzv-id` is not given (the SageMaker runner sets one per job).",
    ),
    "TORCHFLEET_METADATA_ENDPOINT": (
        "users",
        "host:port that replaces the clouds' metadata address for"
        " `--preempt-notice` (a proxy, or a test's own server).",
    ),
    "TORCHFLEET_NOTICE_INTERVAL": ("users", "Seconds between two polls of the cloud's spot notice (default 5)."),
    "TORCHFLEET_BENCH_PROFILE": (
        "users",
        "A directory: bench profiles each cell's kernels and writes the table there (what `make gpu-check` sets).",
    ),
    "TORCHFLEET_PREEMPT_SIGNALS": ("launcher", "`run --preempt-signals`, passed to the script's Fleet."),
    "TORCHFLEET_RANK_VIEW": (
        "users",
        "`1` gives a Fleet script on several processes the run's services (per-rank figures, straggler"
        " verdicts, the metrics file, the `--dashboard` page): `torchfleet run` sets it, a script under"
        " torchrun or Slurm sets it by hand; `0` turns them off under `torchfleet run`.",
    ),
    "TORCHFLEET_LOG_EVERY": ("launcher", "`run --log-every`: steps between two reads of every rank's figures."),
    "TORCHFLEET_METRICS_OUT": ("launcher", "`run --metrics-out`: the file the per-rank rows go to."),
    "TORCHFLEET_DASHBOARD": ("launcher", "`run --dashboard`: the live page's port (default 8050; 0: any free port)."),
    "TORCHFLEET_PREEMPT_NOTICE": ("launcher", "`run --preempt-notice`, passed to the script's Fleet."),
    "TORCHFLEET_PREEMPT_NOTE": (
        "launcher",
        "The file a preempted worker writes its one sentence to, for the launcher (or Slurm's requeue) to print.",
    ),
    "TORCHFLEET_REPLICA_GROUP": ("launcher", "Under `--fault-tolerance step`: this replica group's index."),
    "TORCHFLEET_REPLICA_GROUPS": ("launcher", "Under `--fault-tolerance step`: how many replica groups the job has."),
    "TORCHFLEET_REPLICA_ADDR": (
        "launcher",
        "Under `--fault-tolerance step`: the address other groups reach this machine at.",
    ),
    "TORCHFLEET_JOIN_TIMEOUT": ("launcher", "`--join-timeout`: seconds a replica group waits for the others."),
    "TORCHFLEET_FAULT": (
        "tests",
        "Injects a fault into a training step, such as"
        " `kill:rank=1:step=7:once=/tmp/fired` (`src/torchfleet/train/faults.py`).",
    ),
    "TORCHFLEET_KILL_IN_SAVE": (
        "tests",
        "STEP: the main rank kills itself in the middle of saving that step's checkpoint.",
    ),
    "TORCHFLEET_PREFLIGHT_JOIN_SECONDS": (
        "launcher",
        "Seconds node 0's preflight waits for every machine to report (default 60), for machines that start"
        " minutes apart.",
    ),
    "TORCHFLEET_PREFLIGHT_TORCH_VERSION": (
        "tests",
        "The torch version this machine reports to the preflight, to show a mismatch between machines.",
    ),
    "TORCHFLEET_PREFLIGHT_TORCHFLEET_VERSION": (
        "tests",
        "The torchfleet version this machine reports to the preflight.",
    ),
    "TORCHFLEET_SAGEMAKER_ROOT": ("tests", "A folder that stands in for SageMaker's `/opt/ml`."),
    "TORCHFLEET_REQUIRE_SYSTEM_TESTS": (
        "tests",
        "`1`: a test whose system part is missing (root, network"
        " namespaces, mpirun, Slurm, torchft) fails instead of skipping;"
        " CI sets it.",
    ),
}


def exit_codes() -> list[tuple[int | str, str, str]]:
    """(status, the constant that produces it or "", what it means)."""
    from torchfleet.launcher.failures import PREEMPTED_EXIT, USAGE_EXIT
    from torchfleet.worker.hang_watchdog import HANG_EXIT

    return [
        (0, "", "The job finished."),
        (
            1,
            "",
            "A failure: a rank raised, a non-finite loss, or a replica group under `--fault-tolerance"
            " step` that cannot go on. When a rank exits with a status of its own, the launcher"
            " returns that status instead, after one summary naming the rank, its host and its last"
            " lines.",
        ),
        (
            USAGE_EXIT,
            "USAGE_EXIT",
            "Bad input: one sentence naming the value and what is accepted, no"
            " traceback, nothing written (see [Errors](errors.md)).",
        ),
        (
            PREEMPTED_EXIT,
            "PREEMPTED_EXIT",
            "Preempted: a signal or a spot notice came, the checkpoint was"
            " saved, run again with `--resume auto` (sysexits' EX_TEMPFAIL).",
        ),
        (
            HANG_EXIT,
            "HANG_EXIT",
            "A hang: no rank made progress for `--hang-timeout` seconds; the verdict prints every rank's stack.",
        ),
        (
            "128 + N",
            "",
            "The first rank to fail was killed by signal N (137 is SIGKILL, often the kernel's out-of-memory killer).",
        ),
        (130, "", "Interrupted with Ctrl-C."),
    ]
