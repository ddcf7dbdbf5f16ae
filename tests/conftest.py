"""pytest's hooks and the fixtures every folder of tests/ shares; the helpers are in helpers.py."""

from __future__ import annotations

import os
import resource
import signal
import threading
import time

import pytest

# OpenMP's threads sleep when they wait, in pytest's process and every process it starts (the variable is read as
# torch's OpenMP library loads, so it is set before anything here imports torch). By default a thread that finishes
# its part of an operator spins for the next; on CI's 2 cores the two lanes' processes outnumber the cores, and a
# spinning thread holds a core that another process needed. Measured beside two busy processes on 2 cores:
# tests/strategies/test_experts_tp_ep.py took 162 s spinning and 86 s sleeping; alone, 53.6 s and 54.4 s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from helpers import torchfleet  # noqa: E402 (after the variable above)


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--floor-lane",
        action="store_true",
        help="CI's floor lane (the Makefile's test-floor): the zoo trains a sample of its cells, which the newest"
        " lane trains whole (tests/strategies/test_zoo.py)",
    )
    parser.addoption(
        "--shard",
        default=None,
        help="i/n: run the i-th of n parts of the selected tests, whole files balanced by their measured seconds"
        " (`make test` runs its tests in SHARDS parts side by side)",
    )


# Each test file's wall seconds in CI's two lanes side by side (30 Nov, torch 2.14.1 and 2.11, the tests outside the
# `waits` run; a file in both lanes counts one lane's), for --shard; a file not named counts SHARD_DEFAULT_COST. Wall,
# not CPU: the parts run side by side, so the one with the longest wall sets when `make test` ends. Only the balance
# of the parts reads them: a stale figure slows CI, it does not change what runs.
FILE_COSTS = {
    "tests/replica_groups/test_ft.py": 382,
    "tests/plan/test_plan_at_scale.py": 382,
    "tests/bench/test_bench.py": 290,
    "tests/worker/test_preemption.py": 250,
    "tests/checkpoint/test_reshard.py": 219,
    "tests/strategies/test_zoo.py": 212,
    "tests/strategies/test_experts_tp_ep.py": 172,
    "tests/strategies/test_sharded_pipelined.py": 165,
    "tests/launcher/test_elastic.py": 164,
    "tests/hogwild/test_hogwild.py": 156,
    "tests/plan/test_plan.py": 156,
    "tests/weights/test_weights.py": 140,
    "tests/worker/test_preempt_run.py": 139,
    "tests/test_cli.py": 139,
    "tests/launcher/test_launch.py": 138,
    "tests/strategies/test_real_models.py": 131,
    "tests/run_services/test_slow_link.py": 128,
    "tests/launcher/test_multinode.py": 125,
    "tests/test_docs.py": 122,
    "tests/clusters/test_sagemaker.py": 107,
    "tests/strategies/test_expert_parallel.py": 104,
    "tests/clusters/test_kubernetes.py": 102,
    "tests/strategies/test_registry.py": 100,
    "tests/strategies/test_schedules.py": 97,
    "tests/plan/test_plan_memory_schedules.py": 97,
    "tests/verify/test_verify.py": 95,
    "tests/plan/test_plan_memory_traced.py": 90,
    "tests/launcher/test_run_output.py": 89,
    "tests/test_allocator.py": 82,
    "tests/train/test_faults.py": 80,
    "tests/strategies/test_batchnorm.py": 75,
    "tests/clusters/test_requeue.py": 65,
    "tests/checkpoint/test_checkpoint.py": 63,
    "tests/plan/test_plan_experts.py": 63,
    "tests/clusters/test_mpi.py": 59,
    "tests/train/test_strategy_spec_carried.py": 58,
    "tests/test_outputs.py": 56,
    "tests/view/test_view.py": 54,
    "tests/run_services/test_fleet_services.py": 52,
    "tests/clusters/test_slurm.py": 48,
    "tests/plan/test_plan_compiled.py": 45,
    "tests/train/test_trainer.py": 40,
    "tests/run_services/test_metrics.py": 38,
    "tests/plan/test_plan_encoders.py": 36,
    "tests/strategies/test_single_process.py": 34,
    "tests/launcher/test_notebook.py": 32,
    "tests/launcher/test_torchrun_compat.py": 30,
}
SHARD_DEFAULT_COST = 10


def pytest_collection_modifyitems(config, items) -> None:
    """--floor-lane leaves out the tests marked `newest_lane`. --shard i/n: keep the test files the i-th of n runs
    gets, whole files (a module's fixtures run once), each file to the run with the fewest seconds so far, the
    costliest first (FILE_COSTS)."""
    if config.getoption("floor_lane"):
        left = [item for item in items if item.get_closest_marker("newest_lane")]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [item for item in items if not item.get_closest_marker("newest_lane")]
    shard = config.getoption("shard")
    if not shard:
        return
    index, count = (int(x) for x in shard.split("/"))
    files = sorted({item.nodeid.split("::")[0] for item in items})
    load, owner = [0.0] * count, {}
    for path in sorted(files, key=lambda p: (-FILE_COSTS.get(p, SHARD_DEFAULT_COST), p)):
        lightest = load.index(min(load))
        owner[path] = lightest
        load[lightest] += FILE_COSTS.get(path, SHARD_DEFAULT_COST)
    ours = [owner[item.nodeid.split("::")[0]] == index - 1 for item in items]
    config.hook.pytest_deselected(items=[item for item, mine in zip(items, ours, strict=True) if not mine])
    items[:] = [item for item, mine in zip(items, ours, strict=True) if mine]


def pytest_configure(config) -> None:
    """SIGTERM and SIGINT stop the run as Ctrl-C does: KeyboardInterrupt in pytest's own process, so the test's
    children are killed (subprocess.run kills its child on any exception) and fixtures stop what they started
    (a Slurm cluster's daemons, which leave their process group). SIGINT too, because `make test` starts one
    of its two runs in the background, where the shell makes it ignore SIGINT. A process forked from this
    one (forked_torchfleet) keeps the default action: only pytest's process raises."""
    main = os.getpid()

    def stop(signum, frame) -> None:
        if os.getpid() != main:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)


@pytest.fixture
def cli():
    return torchfleet


@pytest.fixture(scope="session")
def good_checkpoint(tmp_path_factory):
    """A directory holding one intact checkpoint (serial, mlp, AdamW, synthetic data, step 2)."""
    from torchfleet.train.config import TrainConfig
    from torchfleet.train.loop import train

    directory = tmp_path_factory.mktemp("good") / "ckpt"
    train(
        TrainConfig(
            strategy="serial",
            model="mlp",
            data="synthetic",
            synthetic_size=256,
            max_steps=2,
            progress=False,
            checkpoint_dir=str(directory),
            hang_timeout=0,
        ),
        "serial",
    )
    return directory


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """A test that leaves torch's thread count changed fails, and the count is put back for the tests after it.

    The count is process-wide, and a step's reductions split their sums by it: a serial run in pytest's process
    at one thread and the same run in a child at two differ in the last bits, so an exact comparison of the
    two (tests/strategies/test_equivalence.py, tests/worker/test_preemption.py) would fail tests later in the
    run for a reason of this one's making."""
    import torch

    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"torch's thread count was {before} before this test and {after} after it")


_FILE_SECONDS: dict[str, float] = {}
_FILE_CPU: dict[str, float] = {}


def _cpu_seconds() -> float:
    """User and system seconds of pytest's process, of every child it has waited for (and theirs, each waited
    for by its parent), and of its children still running with the children they have waited for: a
    forkserver's workers (torchfleet.launch) are reaped by the server, which lives as long as pytest. The work
    a test gave the cores, which is what slows the tests beside it."""
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux: the reaped children only
        return seconds
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # it ended between the two reads
                continue
            seconds += sum(int(v) for v in fields[11:15]) / tick  # utime, stime, cutime, cstime
    return seconds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _cpu_seconds()
    start = time.monotonic()
    yield
    path = item.nodeid.split("::")[0]
    spent = _cpu_seconds() - before
    _FILE_CPU[path] = _FILE_CPU.get(path, 0.0) + spent
    costs = os.environ.get("TORCHFLEET_TEST_COSTS")
    if costs:  # each test's wall and CPU seconds, one line each: what the tiers (the `slow` marker) are chosen by
        with open(costs, "a") as f:
            f.write(f"{time.monotonic() - start:.1f}\t{spent:.1f}\t{item.nodeid}\n")


def pytest_runtest_logreport(report) -> None:
    """Each test file's seconds (set-up, call and tear-down), for the summary below."""
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """The slowest test files, with the CPU seconds they spent: what the Makefile's lanes (FLOOR_ONLY_TESTS)
    are balanced by, and where a cheaper test shortens both lanes."""
    if not _FILE_SECONDS:
        return
    terminalreporter.section("slowest files")
    terminalreporter.write_line("  wall s    CPU s file")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f} {_FILE_CPU.get(path, 0.0):8.1f} {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f} {sum(_FILE_CPU.values()):8.1f} in all")
