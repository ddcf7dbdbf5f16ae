"""The multi-stage pipeline schedules compute what serial computes, save, resume, and refuse in one sentence.

interleaved-1f1b, looped-bfs, interleaved-zb and zbv on 2 processes with 4
stages (2 per process): the CNN (4 layers with parameters, one per stage)
under each, library models under some, predict on a model returning its own
loss, and a checkpoint written with 2 stages per process loaded back and
into serial. One launch runs them all; a second, of 4 processes, runs
ddp+pipeline and fsdp+pipeline with 2 stages per process and GPT-2 in 4
stages under 1f1b (its attention mask, made in the first stage, is carried
through the others: strategies/pipeline/skips.py). On a torch without a schedule's
class, the refusal is what is checked.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from torch import nn
from torch.distributed import pipelining

from helpers import require_system, torchfleet
from torchfleet import Fleet, launch
from torchfleet.errors import UsageError
from torchfleet.strategies import resolve_dims
from torchfleet.strategies.pipeline.schedules import (
    MULTI_STAGE,
    NEEDS_RELEASE,
    available,
    bubble_formula,
    local_stages,
    stage_ranks,
)
from torchfleet.testing.equivalence import full_weights, train_k_steps
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import build_model, build_optimizer
from torchfleet.versions import release

HERE = [s for s in MULTI_STAGE if s in available()]
PEFT = importlib.util.find_spec("peft") is not None
CNN = {"model": "cnn", "optimizer": "sgd", "stages_per_process": 2}
CASES = [dict(CNN, schedule=s) for s in HERE] + [dict(CNN, schedule="interleaved-1f1b", grad_accum=2, microbatches=2)]
# A library model with tied embeddings, cut by its own plan: under zbv the embedding and the
# head are on the same process (stages 0 and 3), under interleaved 1F1B on two. And a Llama and a Qwen2
# with peft's LoRA adapters, whose plan is found through peft's wrapping, under a multi-stage schedule.
LIBRARY = [("hf-llama-tied", s) for s in ("zbv", "interleaved-1f1b") if s in HERE]
LIBRARY += [(m, "interleaved-1f1b") for m in ("peft-llama", "peft-qwen2") if "interleaved-1f1b" in HERE and PEFT]
# peft's LoRA under the other multi-stage schedules too (1f1b and gpipe: test_zoo's pipeline cells).
LIBRARY += [("peft-llama", s) for s in HERE if s != "interleaved-1f1b" and PEFT]
# Families whose forward transforms the logits after the head (Gemma 2's soft-capping, Cohere's logit_scale): an
# earlier stage must send its last block's output, not the forward's (1f1b: test_zoo's pipeline cells).
LIBRARY += [(m, "interleaved-1f1b") for m in ("hf-gemma2", "hf-cohere") if "interleaved-1f1b" in HERE]
OLD = [s for s, floor in NEEDS_RELEASE.items() if release() < floor]  # here, but refused on this torch
# GPT-2 traced into 4 stages: its attention mask goes from stage 0 to every later stage. Before
# torch 2.14 a bool tensor between stages is refused (cutting._refuse_integer_activations).
GPT2 = [("pipeline", "interleaved-1f1b", {"stages_per_process": 2})] if "interleaved-1f1b" in HERE else []
GPT2_FOUR = [("pipeline", "1f1b", {"microbatches": 4})]
MASK_REFUSED = "this cut sends torch.bool tensors between pipeline stages"
# On 4 processes, 2 pipelines of 2 processes with 2 stages each (strategies/dims.py's presets).
FOUR = [dict(CNN, schedule="interleaved-1f1b", pp=2, strategy=s) for s in ("ddp+pipeline", "fsdp+pipeline")]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
STEPS = 3


def _library(name: str, schedule: str | None, strategy: str = "pipeline", **options) -> dict | None:
    """Zoo model `name` after STEPS SGD steps (under serial without a schedule); {"refused": the sentence}
    where the pipeline refuses it (every rank alike, at setup)."""
    from zoo import ZOO, _rows

    entry = ZOO[name]
    options = {"schedule": schedule, "stages_per_process": 2, **options} if schedule else {}
    fleet = Fleet(strategy=strategy if schedule else "serial", **options)
    torch.manual_seed(0)
    net = entry.build()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    batches = [entry.batch(8, seed) for seed in range(STEPS)]
    try:
        fleet.setup(net, opt, example_inputs=batches[0][0])
    except UsageError as error:
        return {"refused": str(error)}
    for inputs, targets in batches:
        fleet.train_step(*_rows((inputs, targets), 0, 1), entry.loss)
    state, _ = fleet.strategy.state_dicts()
    return {k: v.detach().float().cpu().clone() for k, v in state.items()} if fleet.is_main else None


def _predict(schedule: str | None) -> dict:
    """nanoGPT (it computes its loss from the targets, in the last stage) predicting: (logits, loss) of a
    batch of 8 on the process with the last stage, and the refusal of a batch of 7 (a padded chunk)."""
    from zoo import ZOO

    entry = ZOO["nanogpt"]
    options = {"schedule": schedule, "stages_per_process": 2} if schedule else {}
    fleet = Fleet(strategy="pipeline" if schedule else "serial", **options)
    torch.manual_seed(0)
    net = entry.build()
    inputs, _ = entry.batch(8, 0)
    fleet.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2), example_inputs=inputs)
    found: dict = {"full": fleet.predict(entry.batch(8, 1)[0])}
    try:
        fleet.predict({k: v[:7] for k, v in entry.batch(8, 2)[0].items()})
    except UsageError as error:
        found["refused7"] = str(error)
    return found


def _first_two_losses(strategy: str, **options) -> tuple[Fleet, list, list[float]]:
    """The CNN's fleet after 2 AdamW steps, its 4 batches, and the loss train_step returned at each step.

    Every process reports the batch's loss, sent from the last stage: at the first step the receive is
    posted before the schedule runs (Gloo's way), at the second after it (NCCL's way, which has no tags
    to keep the loss apart from the schedule's messages; strategies/pipeline/stages.py)."""
    from torchfleet.strategies.pipeline import strategy as pipeline

    fleet = Fleet(strategy=strategy, **options)
    torch.manual_seed(0)
    net = build_model("cnn", (1, 8, 8), 10)
    fleet.setup(net, build_optimizer("adamw", net.parameters(), 1e-3))
    batches = list(fleet.dataloader(synthetic(32 * 4, seed=1), 32, seed=1))
    losses, tagged = [], pipeline.TAGGED_BACKENDS
    for posted_late, (x, y) in enumerate(batches[:2]):
        pipeline.TAGGED_BACKENDS = () if posted_late else tagged
        losses.append(float(fleet.train_step(x, y, nn.CrossEntropyLoss())))
    pipeline.TAGGED_BACKENDS = tagged
    return fleet, batches, losses


def _schedule_seen(schedule: str) -> dict:
    """What runs for `schedule` (2 stages per process where it takes several, 4 micro-batches): torch's class
    and, for the multi-stage schedules, this process's actions in order, as (stage, kind, micro-batch)."""
    per = 1 if schedule in ("gpipe", "1f1b") else 2
    fleet = Fleet(strategy="pipeline", schedule=schedule, stages_per_process=per, microbatches=4)
    torch.manual_seed(0)
    net = build_model("cnn", (1, 8, 8), 10)
    fleet.setup(net, build_optimizer("sgd", net.parameters(), 1e-2))
    x, y = next(iter(fleet.dataloader(synthetic(32, seed=1), 32, seed=1)))
    fleet.train_step(x, y, nn.CrossEntropyLoss())
    running = fleet.strategy._schedule
    order = getattr(running, "pipeline_order", {}).get(fleet.strategy.pp_rank, [])
    return {
        "class": type(running).__name__,
        "actions": [(a.stage_index, a.computation_type.name, a.microbatch_index) for a in order if a is not None],
    }


def _save_and_load(directory: str) -> dict:
    """Train 2 steps with 2 stages per process, save (sharded and full), train 2 more, load, train the 2 again."""
    fleet, batches, losses = _first_two_losses("pipeline", schedule="interleaved-1f1b", stages_per_process=2)
    loss_fn = nn.CrossEntropyLoss()
    fleet.save(f"{directory}/sharded", step=2)
    fleet.save(f"{directory}/full", sharded=False, step=2)
    saved = full_weights(fleet)
    for x, y in batches[2:]:
        fleet.train_step(x, y, loss_fn)
    straight = full_weights(fleet)
    resumed = []
    for layout in ("sharded", "full"):
        fleet.load(f"{directory}/{layout}")
        for x, y in batches[2:]:
            fleet.train_step(x, y, loss_fn)
        resumed.append(full_weights(fleet))
    report = fleet.strategy.pipeline_report()
    return {"saved": saved, "straight": straight, "resumed": resumed, "report": report, "losses": losses}


def _job(directory: str) -> dict:
    weights = [train_k_steps("pipeline", steps=STEPS, **case) for case in CASES]
    library = [_library(name, schedule) for name, schedule in LIBRARY] if HAS_TRANSFORMERS else []
    gpt2 = [_library("hf-gpt2", s, strategy, **o) for strategy, s, o in GPT2] if HAS_TRANSFORMERS else []
    predicted = _predict("interleaved-1f1b") if "interleaved-1f1b" in HERE else None
    checkpoint = _save_and_load(directory)
    seen = {name: _schedule_seen(name) for name in available()}
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return {
        "weights": weights,
        "library": library,
        "gpt2": gpt2,
        "predict": predicted,
        "checkpoint": checkpoint,
        "seen": seen,
    }


def _four_job() -> dict:
    weights = [
        train_k_steps(case["strategy"], steps=STEPS, **{k: v for k, v in case.items() if k != "strategy"})
        for case in FOUR
    ]
    gpt2 = (
        [_library("hf-gpt2", s, strategy, stages_per_process=1, **o) for strategy, s, o in GPT2_FOUR]
        if HAS_TRANSFORMERS
        else []
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return {"weights": weights, "gpt2": gpt2}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("schedules")
    every = launch(_job, nprocs=2, args=(str(directory),))
    found = every[0]
    found["directory"] = directory
    found["losses"] = [r["checkpoint"]["losses"] for r in every]
    # predict returns the outputs on the process holding the last stage (rank 1 in a loop of 2)
    found["predict"] = next(
        (r["predict"] for r in every if r["predict"] and r["predict"]["full"] is not None), every[0]["predict"]
    )
    return found


@pytest.fixture(scope="module")
def four() -> dict:
    return launch(_four_job, nprocs=4)[0]


def _serial(case: dict) -> torch.Tensor:
    plain = {
        k: v for k, v in case.items() if k not in ("schedule", "microbatches", "stages_per_process", "pp", "strategy")
    }
    return _serial_run(tuple(sorted(plain.items())))


@functools.lru_cache(maxsize=None)
def _serial_run(plain: tuple) -> torch.Tensor:  # the cases of several layouts share one serial run
    return train_k_steps("serial", steps=STEPS, **dict(plain))


@pytest.mark.timeout(300)
def test_each_schedule_equals_serial_with_two_stages_per_process(results):
    assert HERE, "no multi-stage schedule on this torch (the refusals are checked below)"
    for case, got in zip(CASES, results["weights"], strict=True):
        diff = (got - _serial(case)).abs().max().item()
        assert diff < 1e-5, f"{case}: max weight difference {diff:.3g}"
        untouched = train_k_steps("serial", steps=1, model="cnn", optimizer="sgd", lr=1e-12)
        assert (got - untouched).abs().max().item() > 1e-3  # training moved the weights


# torch's class for each --schedule, written out here rather than read from schedules.SCHEDULES, so that a
# wrong entry there fails (every schedule computes the same gradients: equal weights cannot tell them apart).
CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


def test_each_schedule_runs_its_own_class_and_order_of_actions(results):
    """On process 0 with 4 micro-batches: zero-bubble schedules split each backward into the input's
    gradient and the weights' (later); the others run whole backwards. Looped BFS runs every micro-batch
    through its first stage before its second; interleaved 1F1B starts its second stage sooner."""
    seen = results["seen"]
    assert set(seen) == set(available())
    for name, found in seen.items():
        assert found["class"] == CLASSES[name], (name, found["class"])
        if name in ("gpipe", "1f1b"):
            continue
        kinds = {kind for _, kind, _ in found["actions"]}
        split = name in ("interleaved-zb", "zbv")
        assert ({"BACKWARD_INPUT", "BACKWARD_WEIGHT"} <= kinds) == split, (name, kinds)
        assert ("FULL_BACKWARD" in kinds) != split, (name, kinds)
        forwards = [stage for stage, kind, _ in found["actions"] if kind == "FORWARD"]
        first, second = sorted(set(forwards))
        assert forwards.count(first) == forwards.count(second) == 4, (name, forwards)
        breadth_first = forwards == [first] * 4 + [second] * 4
        assert breadth_first == (name == "looped-bfs"), (name, forwards)


@pytest.mark.timeout(300)
def test_library_models_cut_by_their_own_plans_equal_serial(results):
    if not LIBRARY:
        pytest.skip("neither zbv nor interleaved-1f1b runs on this torch")
    if not HAS_TRANSFORMERS:
        require_system("transformers (the test extra) builds the library model")
    for (name, schedule), got in zip(LIBRARY, results["library"], strict=True):
        want = _library(name, None)
        assert list(got) == list(want)
        diff = max((want[k] - got[k]).abs().max().item() for k in want)
        assert diff < 1e-5, f"{name} under {schedule}: max weight difference {diff:.3g}"


@pytest.mark.newest_lane  # the floor lane's schedules cut two stages a process; this one's calls are the same
@pytest.mark.timeout(300)
def test_gpt2_cut_into_four_stages_equals_serial(results, four):
    if not HAS_TRANSFORMERS:
        require_system("transformers (the test extra) builds GPT-2")
    want = _library("hf-gpt2", None)
    assert want is not None
    for (strategy, schedule, _), got in zip(GPT2 + GPT2_FOUR, results["gpt2"] + four["gpt2"], strict=True):
        if release() < (2, 14):
            assert MASK_REFUSED in got["refused"] and "\n" not in got["refused"], got
            continue
        assert "refused" not in got, got["refused"]
        assert list(got) == list(want)
        diff = max((want[k] - got[k]).abs().max().item() for k in want)
        assert diff < 1e-5, f"hf-gpt2 under {strategy} {schedule}: max weight difference {diff:.3g}"


@pytest.mark.timeout(300)
def test_predict_on_a_model_returning_its_own_loss_with_two_stages_per_process(results):
    found = results["predict"]
    if found is None:
        pytest.skip("no interleaved-1f1b on this torch")
    want = _predict(None)
    (logits, loss), (want_logits, want_loss) = found["full"], want["full"]
    assert logits.shape == want_logits.shape and loss.dim() == 0
    assert (logits - want_logits).abs().max().item() < 1e-5
    assert abs(loss.item() - want_loss.item()) < 1e-5  # the mean of the full chunks' means
    assert "refused7" not in want  # serial predicts any number of rows
    assert found["refused7"] == (
        "this model returns a scalar (its loss) and its pipeline stages take micro-batches"
        " of 2, so predict on 7 rows would pad the last one and count the padding in that"
        " scalar; predict on a multiple of 2 rows"
    )


@pytest.mark.timeout(300)
def test_replicated_and_sharded_pipelines_with_two_stages_per_process_equal_serial(four):
    for case, got in zip(FOUR, four["weights"], strict=True):
        diff = (got - _serial(case)).abs().max().item()
        assert diff < 1e-5, f"{case}: max weight difference {diff:.3g}"


@pytest.mark.timeout(300)
def test_every_process_returns_the_last_stages_loss(results):
    first, second = results["losses"]
    serial = _first_two_losses("serial")[2]
    assert first == second, "the two processes returned different losses"
    assert max(abs(a - b) for a, b in zip(first, serial, strict=True)) < 1e-5, (first, serial)


def test_checkpoints_with_two_stages_per_process_load_back_and_into_serial(results):
    check = results["checkpoint"]
    for resumed in check["resumed"]:
        assert (resumed - check["straight"]).abs().max().item() == 0  # bit for bit
    report = check["report"]
    assert report["stages"] == 4 and report["stages_per_process"] == 2 and len(report["bubble_measured"]) == 2
    for layout in ("sharded", "full"):  # resharded: 4 stages on 2 processes into one process
        fleet = Fleet(strategy="serial")
        torch.manual_seed(3)
        net = build_model("cnn", (1, 8, 8), 10)
        fleet.setup(net, build_optimizer("adamw", net.parameters(), 1e-3))
        fleet.load(results["directory"] / layout)
        assert (full_weights(fleet) - check["saved"]).abs().max().item() == 0, layout


def test_stage_placement_loops_or_makes_a_v():
    assert stage_ranks("interleaved-1f1b", 2, 2) == [0, 1, 0, 1]
    assert stage_ranks("zbv", 2, 2) == [0, 1, 1, 0]
    assert local_stages("zbv", 4, 2, 1) == [1, 6] and local_stages("looped-bfs", 4, 2, 1) == [1, 5]
    assert bubble_formula("1f1b", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_formula("interleaved-1f1b", 4, 2, 8) == pytest.approx(3 / 19)
    assert bubble_formula("interleaved-zb", 4, 2, 8) == pytest.approx(1 / 17)  # (p-1)/3 idle of 16 busy slots
    assert bubble_formula("zbv", 4, 2, 8) == 0.0


REFUSALS = [
    (
        ["--schedule", "1f1b", "--stages-per-process", "2"],
        "schedule 1f1b runs one stage per process and --stages-per-process is 2",
    ),
    (
        ["--schedule", "interleaved-1f1b"],
        "schedule interleaved-1f1b runs several stages on each process; give --stages-per-process 2 or more",
    ),
    (["--schedule", "zbv", "--stages-per-process", "3"], "schedule zbv places exactly 2 stages on each process"),
    (
        ["--schedule", "interleaved-1f1b", "--stages-per-process", "2", "--microbatches", "5"],
        "--microbatches 5 on 2 processes is not a whole number of rounds; use a multiple of 2",
    ),
    (["--stages-per-process", "0"], "--stages-per-process 0 must be a whole number, at least 1"),
]


@pytest.mark.parametrize("flags, sentence", REFUSALS, ids=[" ".join(f) for f, _ in REFUSALS])
def test_combinations_that_cannot_run_are_one_sentence_before_any_process_starts(flags, sentence):
    # resolve_dims is what `train` checks before starting workers; the CLI row proves exit 2.
    options = {
        f[2:].replace("-", "_"): (v if f == "--schedule" else int(v))
        for f, v in zip(flags[::2], flags[1::2], strict=True)
    }
    with pytest.raises(UsageError) as info:
        resolve_dims("pipeline", 2, options=options)
    assert sentence in str(info.value) and "\n" not in str(info.value)


@pytest.mark.timeout(120)
def test_a_refusal_from_the_command_line_is_exit_2_without_a_traceback():
    out = torchfleet(
        "train",
        "--strategy",
        "pipeline",
        "-n",
        "2",
        "--model",
        "cnn",
        "--schedule",
        "zbv",
        "--stages-per-process",
        "3",
        "--no-progress",
        timeout=100,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "torchfleet train: error: schedule zbv places exactly 2 stages on each process (a V) and --stages-per-process is 3;"
        " give --stages-per-process 2"
    ]


def test_a_schedule_the_installed_torch_lacks_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.delattr(pipelining, "ScheduleZBVZeroBubble")
    with pytest.raises(UsageError) as info:
        resolve_dims("pipeline", 2, options={"schedule": "zbv", "stages_per_process": 2})
    message = str(info.value)
    assert "schedule zbv needs torch's ScheduleZBVZeroBubble, which torch" in message and "\n" not in message


@pytest.mark.skipif(not OLD, reason="every schedule runs on this torch")
def test_a_schedule_this_torch_cannot_run_is_refused_in_one_sentence():
    for name in OLD:
        with pytest.raises(UsageError) as info:
            resolve_dims("pipeline", 2, options={"schedule": name, "stages_per_process": 2})
        message = str(info.value)
        assert f"schedule {name} needs torch 2.14 or later, and torch" in message and "\n" not in message


def test_bench_runs_other_schedules_only_when_asked():
    from torchfleet.bench.cells import plan, variant
    from torchfleet.bench.config import BenchConfig

    here = [{"name": "serial", "available": True, "why": ""}, {"name": "pipeline", "available": True, "why": ""}]
    cfg = BenchConfig(model="cnn", nproc=(2,), batch_sizes=(64,), precisions=("fp32",))
    assert not any("/" in c.strategy for c in plan(cfg, here, 2)[0])  # not in the default matrix
    asked = BenchConfig(
        model="cnn",
        strategies=("pipeline", "pipeline/interleaved-1f1b"),
        nproc=(2,),
        batch_sizes=(64,),
        precisions=("fp32",),
    )
    assert [c.strategy for c in plan(asked, here, 2)[0]] == ["serial", "pipeline", "pipeline/interleaved-1f1b"]
    assert variant("pipeline/interleaved-1f1b") == (
        "pipeline",
        {"schedule": "interleaved-1f1b", "stages_per_process": 2},
    )
    with pytest.raises(UsageError, match="unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        BenchConfig(strategies=("pipeline/zigzag",))
