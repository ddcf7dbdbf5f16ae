"""torchfleet plan: the formulas on known inputs, fsdp's 16 P / N, predictions against real measured cells,
the command's table, JSON and bad input."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from helpers import assert_refused_in_one_sentence, clean_env, forked_torchfleet, run
from torchfleet.plan import check, comm, contention, overheads, pipelines, predict, probe, profiler, workload
from torchfleet.plan.first_batches import first_batches
from torchfleet.plan.hardware import Target
from torchfleet.plan.layouts import layout
from torchfleet.plan.profile import Profile
from torchfleet.strategies.pipeline.schedules import available

GPT_TINY = {"model": "gpt", "gpt_preset": "tiny", "image_size": 224, "seed": 0, "block_size": 64}


def test_collective_formulas_on_known_inputs():
    link = comm.Link(bandwidth=1e9, latency=1e-4)
    # ring all-reduce: 2(N-1)/N x bytes / bandwidth + 2(N-1) messages
    assert comm.all_reduce_s(1e9, 4, link) == pytest.approx(1.5 + 6e-4)
    assert comm.all_gather_s(1e9, 4, link) == pytest.approx(0.75 + 3e-4)
    assert comm.reduce_scatter_s(1e9, 2, link) == pytest.approx(0.5 + 1e-4)
    assert comm.send_s(2e8, link) == pytest.approx(0.2 + 1e-4)
    assert comm.all_reduce_s(1e9, 1, link) == 0.0  # one rank talks to nobody
    whole, last = comm.bucketed_all_reduce_s(100e6, 2, comm.Link(1e9), bucket_bytes=25e6)
    assert whole == pytest.approx(0.1) and last == pytest.approx(0.025)


@pytest.fixture(scope="module")
def gpt_adamw() -> Profile:
    return profiler.measure(GPT_TINY, "adamw", cores=1, batches=(1, 2), timed_steps=1)


@pytest.mark.slow
def test_the_profile_runs_only_batches_this_machine_holds(monkeypatch):
    # Planning GPT-2 for GPUs on a 24 GB machine used to run its memory batches 8 and 16 on the CPU
    # (about 1.4 GB of activations a sample at 1,024 tokens) and be killed for memory after 5 minutes.
    spec = dict(GPT_TINY)
    roomy = profiler.measure(spec, "adamw", cores=1, batches=(1, 2), timed=False)
    assert roomy.memory_batches == (8, 16)  # 4 and 8 times the larger: where the activations show
    state = 12 * roomy.parameters  # fp32 weights and AdamW's two moments
    model, inputs, targets, loss_fn = workload.workload(spec, 1)
    optimizer = workload.make_optimizer("adamw", model.parameters())
    workload.train_step(model, optimizer, inputs, targets, loss_fn)
    beyond = profiler._phase_peaks(model, optimizer, inputs, targets, loss_fn)[0] - state  # batch 1's, over the state
    # A third of the free memory holds 12 samples' worth, by the profile's over-estimate: batch 8, not 16.
    monkeypatch.setattr(profiler, "_available_memory", lambda: 3 * (state + 12 * beyond))
    assert profiler.measure(spec, "adamw", cores=1, batches=(1, 2), timed=False).memory_batches == (4, 8)
    # Only the state: the line goes through the probe's own batches, and so does the timing.
    monkeypatch.setattr(profiler, "_available_memory", lambda: 3.0 * state)
    tight = profiler.measure(spec, "adamw", cores=1, batches=(1, 2), timed_steps=1, time_at=(16, 8))
    assert tight.memory_batches == (1, 2) and tight.probe_batches == (1, 2)


def test_a_dimension_without_formulas_is_left_out_not_priced_as_another(gpt_adamw, monkeypatch):
    from torchfleet.errors import UsageError
    from torchfleet.plan import layouts

    assert layout("fsdp+tp", 4, 32, gpt_adamw).tp == 2
    # As a dimension declared after the formulas were written (context parallelism) would be.
    monkeypatch.setattr(layouts, "PRICED", tuple(d for d in layouts.PRICED if d != "tp"))
    with pytest.raises(UsageError, match=r"plan does not cost tp\(2\) yet; bench measures fsdp\+tp instead"):
        layout("fsdp+tp", 4, 32, gpt_adamw)
    assert layout("fsdp", 4, 32, gpt_adamw).shard == 4


def test_fsdp_training_state_is_16_bytes_per_parameter_over_n(gpt_adamw):
    target = Target("t", 1, 8, 1e12, comm.Link(1e9), comm.Link(1e9), rate=1e12)
    for n in (2, 4, 8):
        lay = layout("fsdp", n, 32, gpt_adamw)
        state = predict.memory(gpt_adamw, lay, 32)["training_state"]
        assert state == pytest.approx(16 * gpt_adamw.parameters / n, rel=0.01)
        assert predict.predict(gpt_adamw, lay, 32, target, 1, None).fits
    # ddp holds it all on every rank, and its buckets on top
    ddp = predict.memory(gpt_adamw, layout("ddp", 4, 32, gpt_adamw), 32)
    assert ddp["training_state"] == pytest.approx(16 * gpt_adamw.parameters, rel=0.01)
    assert ddp["buffers"] == pytest.approx(4 * gpt_adamw.parameters, rel=0.01)


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1(gpt_adamw):
    target = Target("t", 1, 4, 1e12, comm.Link(1e12), comm.Link(1e12), rate=1e12)
    lay = layout("pipeline", 4, 32, gpt_adamw, {"microbatches": 8})
    times = predict.step_time(gpt_adamw, lay, 32, target, 1, None)
    assert times["bubble"] / times["compute"] == pytest.approx(3 / (8 + 3), rel=0.01)


# p = 4 processes, m = 8 micro-batches, v = 2 stages per process where the schedule takes several
@pytest.mark.parametrize(
    "schedule, v, bubble",
    [
        ("gpipe", None, 3 / (8 + 3)),
        ("1f1b", None, 3 / (8 + 3)),
        ("interleaved-1f1b", 2, 3 / (2 * 8 + 3)),
        ("looped-bfs", 2, 3 / (2 * 8 + 3)),
        ("interleaved-zb", 2, 3 / (3 * 2 * 8 + 3)),  # ZB-H1: a third of 1F1B's fill and drain (Qi et al.)
        ("zbv", 2, 0.0),
    ],
)
def test_each_schedule_has_its_bubble(gpt_adamw, schedule, v, bubble):
    assert pipelines.bubble_fraction(schedule, 4, 8, v or 1) == pytest.approx(bubble, abs=1e-12)
    if schedule not in available():
        return  # an older torch cannot run it (zbv before 2.14), and the plan refuses it as the pipelines do
    target = Target("t", 1, 4, 1e12, comm.Link(1e12), comm.Link(1e12), rate=1e12)
    options = {"microbatches": 8, "schedule": schedule} | ({"stages_per_process": v} if v else {})
    lay = layout("pipeline", 4, 32, gpt_adamw, options)
    assert (lay.schedule, lay.stages_per_process) == (schedule, v or 1)
    times = predict.step_time(gpt_adamw, lay, 32, target, 1, None)
    assert times["bubble"] / times["compute"] == pytest.approx(bubble, abs=1e-9)


def test_schedules_order_their_bubbles_and_activations(gpt_adamw):
    fraction = {s: pipelines.bubble_fraction(s, 4, 8, 2) for s in ("1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")}
    assert fraction["zbv"] < fraction["interleaved-zb"] < fraction["interleaved-1f1b"] < fraction["1f1b"]
    assert pipelines.bubble_fraction("interleaved-1f1b", 4, 8, 4) < fraction["interleaved-1f1b"]  # more stages, less

    def activations(schedule, v=None):
        options = {"microbatches": 8, "schedule": schedule} | ({"stages_per_process": v} if v else {})
        return predict.memory(gpt_adamw, layout("pipeline", 4, 32, gpt_adamw, options), 32)["activations"]

    per_micro = 4 * gpt_adamw.activation_per_sample  # a micro-batch of 4 samples through the whole model
    rest = activations("1f1b") - per_micro * 4 / 4  # what no schedule changes: the hand-overs, the fixed part
    assert rest > 0
    # 1f1b holds the 4 micro-batches in flight on a stage's quarter of the layers, gpipe all 8
    assert activations("gpipe") == pytest.approx(rest + per_micro * 8 / 4)
    # interleaving holds (1 + (p-1)/(p v)) times 1F1B's (Korthikanti et al.)
    assert activations("interleaved-1f1b", 2) == pytest.approx(rest + per_micro * (1 + 3 / 8))
    if "zbv" in available():
        assert activations("zbv", 2) == pytest.approx(activations("1f1b"))


def test_a_described_cluster_plans_every_preset_and_recommends_one(tmp_path):
    out = tmp_path / "plan.json"
    result = forked_torchfleet(
        "plan",
        "--model",
        "gpt",
        "--gpt-preset",
        "tiny",
        "--batch-size",
        "64",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--gpu",
        "A100",
        "--link",
        "100",
        "--json-out",
        str(out),
        "--chart",
        str(tmp_path / "plan.png"),
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["target"]["nodes"] == 2 and doc["target"]["rate"] == pytest.approx(
        19.5e12 * 0.65
    )  # fp32: the plain FP32 peak
    names = {(p["strategy"], p["processes"]) for p in doc["predictions"]}
    assert {("serial", 1), ("ddp", 8), ("fsdp", 8), ("pipeline", 4), ("tp", 2), ("diloco", 8)} <= names
    assert doc["recommendation"]["best"]["strategy"] in {s for s, _ in names}
    assert "the fastest that fits" in result.stdout and (tmp_path / "plan.png").stat().st_size > 0


@pytest.mark.parametrize(
    "written, gbit",
    [
        ("100", 100.0),
        ("100Gb/s", 100.0),
        ("400 Gbit/s", 400.0),
        ("400Gbps", 400.0),
        ("800Mb/s", 0.8),
        ("1Tb/s", 1000.0),
        ("900GB/s", 7200.0),
        ("100MBps", 0.8),
        ("12.5 GB/s", 100.0),
    ],
)
def test_a_bandwidth_is_read_with_its_unit(written, gbit):
    """Bits with a lower-case b (or "bit"), bytes with an upper-case B, as datasheets write them."""
    from torchfleet.cli.plan import gbit_per_s

    assert gbit_per_s("--link")(written) == pytest.approx(gbit)


def test_a_link_written_with_its_unit_plans_as_the_bare_number(tmp_path):
    outs = []
    for link in ("400", "400Gb/s", "50GB/s"):
        out = tmp_path / f"{link.replace('/', '_')}.json"
        result = forked_torchfleet(
            "plan",
            "--model",
            "mlp",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--gpu",
            "H100",
            "--link",
            link,
            "--json-out",
            str(out),
        )
        assert result.returncode == 0, result.stderr
        outs.append(json.loads(out.read_text())["target"])
    assert outs[0] == outs[1] == outs[2] and outs[0]["inter"]["bandwidth_bytes_s"] == pytest.approx(400e9 / 8)


def test_overhead_per_unit_on_known_inputs():
    # wrapped steps 10 ms and 34 ms at 2 and 10 units, plain 2 ms and 10 ms: 2 ms a unit, 4 ms a step
    unit, step = overheads.per_unit((0.010, 0.034), (0.002, 0.010), units=(2, 10))
    assert unit == pytest.approx(0.002) and step == pytest.approx(0.004)
    assert overheads.per_unit((0.001, 0.001), (0.002, 0.002)) == (0.0, 0.0)  # noise never makes them negative


def test_measured_overheads_enter_the_step_time_as_written(gpt_adamw):
    """fsdp: bytes over the link plus the probe's per-step and per-unit machinery; tp: per parallel Linear;
    a pipeline: per slot; ddp: per step and per gradient tensor; each step, its compute and that. Links with
    no latency keep the sums exact."""
    costs = {
        "fsdp_unit_s": 0.002,
        "fsdp_step_s": 0.003,
        "tp_linear_s": 0.001,
        "tp_step_s": 0.0005,
        "pipeline_slot_s": 0.004,
        "ddp_tensor_s": 1e-5,
        "ddp_step_s": 0.001,
    }
    link = comm.Link(1e9, 0.0)
    calib = probe.Calibration("h", "t", 2, {1: 1e9}, {2: link}, {2: link}, {2: costs})
    here = Target("here", 1, 2, 1e12, link, link, cores_per_node=0, here=True)
    p = gpt_adamw
    bytes_ = 4 * p.parameters

    def comm_of(strategy, options=None):
        lay = layout(strategy, 2, 32, p, options)
        times = predict.step_time(p, lay, 32, here, 2, calib)
        # The step is its compute (the bubble inside it) and the communication left exposed, nothing more:
        # with the parts checked here by hand, the step time is too.
        assert times["step"] == pytest.approx(times["compute"] + times["communication"], rel=1e-12)
        assert 0 <= times["bubble"] < times["compute"]
        return lay, times["communication"]

    _, fsdp = comm_of("fsdp")
    assert fsdp == pytest.approx(3 * comm.all_gather_s(bytes_, 2, link) + 0.003 + 0.002 * p.units)
    _, tp = comm_of("tp")
    blocks = p.units - 1
    activations = 4 * blocks * comm.all_reduce_s(32 * p.boundary_bytes_per_sample, 2, link)  # one reader
    assert tp == pytest.approx(activations + 0.0005 + 0.001 * p.tp_linears)
    lay, pipe = comm_of("pipeline", {"microbatches": 4})
    micro = 32 / 4 * p.boundary_bytes_per_sample / link.bandwidth
    assert pipe == pytest.approx((4 + 2 - 1) * (0.004 + 2 * micro))
    _, ddp = comm_of("ddp")
    assert ddp == pytest.approx(comm.all_reduce_s(bytes_, 2, link) + 0.001 + 1e-5 * p.tensors)


def test_four_processes_use_the_2x2_figures_and_the_measured_slowdown(gpt_adamw):
    """Degrees of 2 among 4 processes take the 2 x 2 mesh's overheads (hsdp its own); the compute is the
    profile's step times the probed slowdown of 4 processes at once; the optimizer step is paid once."""
    p = gpt_adamw
    whole = {
        "fsdp_unit_s": 0.02,
        "fsdp_step_s": 0.0,
        "tp_linear_s": 0.008,
        "tp_step_s": 0.0,
        "ddp_tensor_s": 1e-4,
        "ddp_step_s": 0.003,
        "pipeline_slot_s": 0.005,
    }
    pairs = {overheads.PAIRS + k: v / 2 for k, v in whole.items()} | {"hsdp_unit_s": 0.009, "hsdp_step_s": 0.001}
    link = comm.Link(1e12, 0.0)
    calib = probe.Calibration("h", "t", 2, {1: 1e9}, {4: link}, {4: link}, {4: whole | pairs})
    here = Target("here", 1, 4, 1e12, link, link, cores_per_node=0, here=True)

    def times(strategy):
        lay = layout(strategy, 4, 32, p)
        return predict.step_time(p, lay, 32, here, 2, calib)

    units, linears = p.units, p.tp_linears
    # fsdp over all 4: the whole mesh's figure; hsdp: its own; fsdp+tp: fsdp and tp each over pairs
    assert times("fsdp")["communication"] == pytest.approx(0.02 * units, rel=1e-3)
    assert times("hsdp")["communication"] == pytest.approx(0.001 + 0.009 * units, rel=1e-3)
    assert times("fsdp+tp")["communication"] == pytest.approx(0.01 * units + 0.004 * linears, rel=1e-3)
    serial_like = p.step_fit(1).at(32 / 4)
    assert times("ddp")["compute"] == pytest.approx(2 * serial_like)  # 4 processes on 2 cores take turns
    calib.slowdowns[contention.key(p.workload, 32, 4)] = {4: 3.0}
    assert times("ddp")["compute"] == pytest.approx(3 * serial_like)  # measured: cores and bandwidth shared
    # mp runs the forward and backward once per micro-batch, the optimizer's step once
    fit, opt = p.step_fit(2), p.optimizer_time(2, 0.0)
    mp = predict.step_time(p, layout("mp", 1, 32, p), 32, here, 2, calib)["compute"]
    assert opt > 0 and mp == pytest.approx(
        4 * (fit.fixed_s - min(opt, fit.fixed_s)) + fit.per_sample_s * 32 + min(opt, fit.fixed_s)
    )


# docs/benchmarks/history.md: median |predicted / bench's median step - 1| over a model's cells within 0.25 on a quiet machine
# (0.105 to 0.164), 0.35 to 0.52 at a load average of 5 to 16. This test's cells, at raised priority: 0.14 to 0.29 a
# run, quiet or at a load of 14; with every predicted step doubled 0.22 to 0.62 (a run's calibration moves by up
# to 1.6x), so the doubling is caught by test_measured_overheads_enter_the_step_time_as_written, exactly.
STEP_TIME_CLAIM = 0.35
CHECK_ATTEMPTS = 3


def _check(tmp_path, attempt: int) -> tuple[dict, str]:
    """plan --check of gpt tiny (batch 16): bench's serial cell, and ddp, fsdp and a pipeline on 2 processes of
    one thread each; the plan's JSON and its output. The first
    attempt starts from an empty cache, so the probes run for real (launched Gloo processes); later ones
    --reprobe, so that each attempt's calibration is taken minutes before its own cells."""
    out = tmp_path / f"plan{attempt}.json"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    argv = [
        sys.executable,
        "-m",
        "torchfleet",
        "plan",
        "--model",
        "gpt",
        "--batch-size",
        "16",
        "--strategies",
        "ddp,fsdp,pipeline",
        "--nproc",
        "2",
        "--check",
        "--warmup",
        "1",
        "--steps",
        "3",
        "--json-out",
        str(out),
        *(["--reprobe"] if attempt else []),
    ]
    env = clean_env(**env)
    # The claim is about a user's run, which keeps OpenMP's default wait policy, not the suite's PASSIVE
    # (tests/conftest.py), under which each of a tiny model's small operators wakes a sleeping thread. With it
    # inherited, CI on 29 Nov missed the claim in all three attempts (median errors 0.44 to 0.62); whether the
    # policy or that moment's load made the miss was not found.
    env.pop("OMP_WAIT_POLICY", None)
    result = run(_ahead_of_neighbours(argv), timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text()), result.stdout


def _ahead_of_neighbours(argv: list[str]) -> list[str]:
    """`argv` at a higher scheduling priority than other jobs' processes, where this user may raise it (root,
    as in CI): a timing claim judged while the neighbours take the cores says more about them than about the
    planner. Measured at a load average of 3.5 from another test suite on the 2 cores, without it: the
    2-process cells ran 1.2 to 2 times slower than predicted from one run to the next."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return ["nice", "-n", "-15", *argv]
    return argv


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_check_measures_cells_and_meets_the_step_time_the_docs_claim(tmp_path):
    """The check's rows and summary as the JSON and the output give them; then the claim: the median over the
    cells of |predicted / measured - 1| is within 0.25, and fsdp is predicted and measured slower than ddp
    (Gloo's all-gathers and reduce-scatters against one all-reduce). On a machine shared with others' jobs a
    calibration taken while the neighbours were busy misses by their load (docs/benchmarks/history.md): the plan runs
    ahead of them where it may, and again, with new probes, up to 3 times; the claim must hold in one."""
    doc, stdout = _check(tmp_path, 0)
    assert list((tmp_path / "cache" / "torchfleet").glob("plan-*.json")), "the calibration is cached"
    cal = doc["calibration"]
    assert cal["links"]["2"]["bandwidth_bytes_s"] > 0 and cal["matmul_flops"]["1"] > 0
    # the strategies' overheads, measured with the real wrappers in the probe's two processes
    assert set(cal["overheads"]["2"]) == {
        "fsdp_unit_s",
        "fsdp_step_s",
        "tp_linear_s",
        "tp_step_s",
        "pipeline_slot_s",
        "ddp_tensor_s",
        "ddp_step_s",
    }
    assert all(v >= 0 for v in cal["overheads"]["2"].values()) and cal["overheads"]["2"]["fsdp_unit_s"] > 0
    assert "torchfleet plan: gpt tiny, global batch 16" in stdout
    attempts, busy = [], []
    for attempt in range(CHECK_ATTEMPTS):
        if attempt:
            doc, stdout = _check(tmp_path, attempt)
        cells = {(c["strategy"], c["processes"]): c for c in doc["check"]["cells"]}
        assert set(cells) == {("serial", 1), ("ddp", 2), ("fsdp", 2), ("pipeline", 2)}
        # bench's flags on the check's cells, from the figures as written; the summary names the flagged ones.
        state = doc["check"]["machine_state"]
        assert state["cores"] >= 1 and state["others_cores"] >= 0 and "machine is" in stdout
        judged = [dict(c) for c in doc["check"]["cells"]]
        check.flag(judged, state["cores"], gpus=0)
        assert [c["flags"] for c in judged] == [c["flags"] for c in doc["check"]["cells"]]
        flagged = [c for c in cells.values() if c["flags"]]
        assert len(doc["check"]["summary"]["flagged"]) == len(flagged)
        assert all(f"flagged: {c['flag_reasons'][0]}" in " ".join(stdout.split()) for c in flagged)
        for cell in cells.values():
            assert cell["status"] == "ok", cell
            assert cell["others_cores"] >= 0 and cell["spread"] >= 0
            assert cell["measured_peak_bytes"], cell  # every rank's tensor peak, a pipeline stage's too
            if cell["strategy"] != "pipeline":  # its memory comes from formulas (docs/benchmarks, plan accuracy)
                # peak tensor memory: the acceptance bound for memory predictions on a small model
                assert cell["memory_ratio"] == pytest.approx(1, abs=0.10), cell
            assert cell["step_ratio"] == pytest.approx(cell["predicted_step_s"] / cell["measured_step_s"])
            assert cell["fastest_ratio"] == pytest.approx(cell["predicted_step_s"] / cell["measured_fastest_step_s"])
            assert cell["measured_fastest_step_s"] <= cell["measured_step_s"]
        summary = doc["check"]["summary"]
        printed = re.search(r"check: step time: median \|predicted/measured - 1\| = ([\d.]+) over (\d+) cells", stdout)
        assert printed and float(printed.group(1)) == pytest.approx(summary["step_time"]["median_error"], abs=5e-4)
        assert int(printed.group(2)) == summary["step_time"]["cells"] == 4
        printed = re.search(r"check: peak memory: median \|predicted/measured - 1\| = ([\d.]+)", stdout)
        assert printed and float(printed.group(1)) == pytest.approx(summary["peak_memory"]["median_error"], abs=5e-4)
        error = summary["step_time"]["median_error"]
        ddp, fsdp = cells[("ddp", 2)], cells[("fsdp", 2)]
        ordered = (
            fsdp["predicted_step_s"] > ddp["predicted_step_s"] and fsdp["measured_step_s"] > ddp["measured_step_s"]
        )
        attempts.append(
            (
                round(error, 3),
                ordered,
                {
                    f"{k[0]} x{k[1]}": (round(c["step_ratio"], 2), round(c["fastest_ratio"], 2))
                    for k, c in cells.items()
                },
            )
        )
        print(
            f"attempt {attempt + 1}: median |predicted/measured - 1| = {error:.3f}, fsdp slower than ddp"
            f" predicted and measured: {ordered}; per cell {attempts[-1][2]}"
        )
        if error <= STEP_TIME_CLAIM and ordered:
            return
        busy.append(any("busy" in (c["flags"] or ()) for c in cells.values()))
    if all(busy):  # bench's own rule: a cell measured beside other work gets no verdict, and neither does the claim
        pytest.skip(
            f"every attempt ran beside other work (cells flagged busy); the step-time claim is not judged: {attempts}"
        )
    pytest.fail(
        f"the step-time claim (median error within {STEP_TIME_CLAIM}, fsdp slower than ddp) failed in"
        f" {CHECK_ATTEMPTS} attempts: {attempts}"
    )


def test_the_check_flags_its_cells_as_bench_does():
    """A ddp cell 5 times faster than the serial cell on 2 cores, a cell whose steps spread, a cell beside a load."""

    def row(strategy, processes, step_s, spread=0.05, others=0.0):
        return {
            "strategy": strategy,
            "processes": processes,
            "global_batch": 16,
            "status": "ok",
            "measured_step_s": step_s,
            "spread": spread,
            "others_cores": others,
        }

    rows = [
        row("serial", 1, 0.05),
        row("ddp", 2, 0.01),
        row("fsdp", 2, 0.04, spread=0.6),
        row("pipeline", 2, 0.04, others=1.5),
    ]
    check.flag(rows, cores=2, gpus=0)
    assert [r["flags"] for r in rows] == [["baseline"], ["bound"], ["spread"], ["busy"]]
    assert rows[1]["flag_reasons"][0].startswith("bound: 5.00x serial is more than 2 processes on 2 cores can reach")
    assert check.summary(rows)["flagged"] == [
        "serial x1 at batch 16 (baseline)",
        "ddp x2 at batch 16 (bound)",
        "fsdp x2 at batch 16 (spread)",
        "pipeline x2 at batch 16 (busy)",
    ]


@pytest.mark.parametrize(
    "args, said",
    [
        (["--gpu", "Z100", "--gpus-per-node", "8"], "GPU 'Z100' is not in torchfleet's table"),
        (["--nodes", "0", "--gpus-per-node", "8", "--gpu", "H100"], "--nodes 0 must be at least 1"),
        (
            ["--model", "mlp", "--batch-size", "1000000000000", "--gpu", "T4", "--gpus-per-node", "2"],
            "a global batch of 1000000000000 fits no strategy on 1 x 2 T4",
        ),
        (
            ["--gpu", "H100", "--gpus-per-node", "4", "--schedule", "zbv", "--stages-per-process", "3"],
            "schedule zbv places exactly 2 stages on each process",
        ),
        (
            ["--gpu", "H100", "--gpus-per-node", "8", "--nodes", "2", "--link", "100 furlongs"],
            "--link '100 furlongs' is not a bandwidth; give Gbit/s as a number (100) or with a unit",
        ),
    ],
    ids=["unknown-gpu", "zero-nodes", "batch-fits-nowhere", "bad-schedule", "bad-link"],
)
def test_bad_input_is_one_sentence(args, said):
    assert_refused_in_one_sentence(forked_torchfleet("plan", *args), said)


def test_the_calibration_cache_is_keyed_by_torchfleets_version_and_the_probes_code(monkeypatch, tmp_path):
    """A probe whose code changed measures something else: its old figures must not be read."""
    import shutil

    import torchfleet

    here = probe.cache_path()
    assert f"-torchfleet{torchfleet.__version__}-" in here.name
    for name in probe.PROBING_MODULES:
        shutil.copy(probe.Path(probe.__file__).parent / name, tmp_path / name)
    monkeypatch.setattr(probe, "__file__", str(tmp_path / "probe.py"))
    assert probe.cache_path() == here  # the same code, the same cache
    with (tmp_path / "overheads.py").open("a") as changed:
        changed.write("\n# a changed probe\n")
    assert probe.cache_path() != here


@pytest.mark.timeout(120)
def test_a_plan_in_bf16_counts_the_activations_that_autocast_keeps():
    """An H100 measured resnet50's bf16 step at batch 512 at 21.64 GiB against fp32's 41.59; the planner
    said 39.85 for both until its profile ran under autocast (on fake tensors: no bf16 arithmetic on a CPU
    without it, which ran gpt2 about 50 times slower than fp32)."""
    spec = {"model": "gpt", "gpt_preset": "tiny", "image_size": 224, "seed": 0, "block_size": 64}
    fp32 = profiler.measure({**spec, "precision": "fp32"}, "sgd", 1, timed=False)
    bf16 = profiler.measure({**spec, "precision": "bf16"}, "sgd", 1, timed=False)
    ratio = bf16.activation_per_sample / fp32.activation_per_sample
    assert 0.5 < ratio < 0.8, ratio  # 0.68: bf16 where autocast casts, fp32 for the loss and norms
    assert bf16.parameters == fp32.parameters and bf16.flops_per_sample == fp32.flops_per_sample


@pytest.mark.timeout(120)
def test_a_model_that_cannot_train_on_one_sample_is_profiled_from_two():
    """resnet18 at 32 px ends in 1 x 1 feature maps, where BatchNorm refuses a single sample; a loaded machine
    once timed it slow enough to profile it at batches 1 and 2, and its plan failed there. It is profiled at 2
    and 4 instead, on a machine of any speed; the model without BatchNorm keeps 1 and 2."""
    resnet = {"model": "resnet18", "gpt_preset": "tiny", "image_size": 32, "seed": 0, "precision": "fp32"}
    gpt = {**resnet, "model": "gpt"}
    assert first_batches(resnet, "sgd", 1, timed=False) == (2, 4)
    assert first_batches(gpt, "sgd", 1, timed=False) == (1, 2)
    profile = profiler.measure(resnet, "sgd", 1, timed=False)  # failed at batch 1 before
    assert profile.probe_batches == (2, 4) and profile.activation_per_sample > 0
