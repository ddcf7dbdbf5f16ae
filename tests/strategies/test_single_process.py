"""dp and mp, the single-process strategies: the same weights as serial, and how they cut."""

import pytest
import torch
from torch import nn

import torchfleet
from torchfleet import UsageError
from torchfleet.strategies.dp import scatter_sizes
from torchfleet.strategies.mp import MicroBatchPipe, balanced_split, split_sequential
from torchfleet.testing.equivalence import train_k_steps
from torchfleet.train.models import cnn, mlp

TOL = 1e-5
MODELS = [("mlp", {"optimizer": "sgd"}), ("cnn", {"optimizer": "adamw", "lr": 1e-3})]


def _close(got, want, what):
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"{what}: max weight difference {diff:.3g}"


@pytest.mark.parametrize("model,opts", MODELS, ids=[m for m, _ in MODELS])
def test_mp_and_dp_match_serial(model, opts):
    serial = train_k_steps("serial", model=model, steps=4, **opts)
    untouched = train_k_steps("serial", model=model, steps=1, **dict(opts, lr=1e-12))
    assert (serial - untouched).abs().max().item() > 1e-3  # training moved the weights
    for microbatches in (1, 3, 4):
        got = train_k_steps("mp", model=model, steps=4, devices="cpu,cpu", microbatches=microbatches, **opts)
        _close(got, serial, f"mp {model} microbatches={microbatches}")
    got = train_k_steps("mp", model=model, steps=4, devices="cpu,cpu,cpu", microbatches=5, grad_accum=2, **opts)
    _close(got, serial, f"mp {model} 3 stages, grad_accum 2")
    _close(train_k_steps("dp", model=model, steps=4, **opts), serial, f"dp {model}")


@pytest.mark.parametrize(
    "strategy,options", [("serial", {}), ("dp", {}), ("hogwild", {}), ("mp", {"devices": "cpu,cpu", "microbatches": 2})]
)
def test_loader_built_before_setup(strategy, options):
    """Scripts often build the loader first: it must read what one built after setup reads."""
    want = train_k_steps("serial", steps=3)
    got = train_k_steps(strategy, steps=3, loader_first=True, **options)
    _close(got, want, f"{strategy}, loader before setup")


def test_mp_user_stages_match_serial():
    def job(strategy, **options):
        torch.manual_seed(0)
        whole = mlp()
        opt = torch.optim.SGD(whole.parameters(), lr=0.1)
        fleet = torchfleet.Fleet(strategy=strategy, **options)
        given = [whole[:3], whole[3:]] if strategy == "mp" else whole
        model, opt = fleet.setup(given, opt)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.rand(24, 1, 8, 8, generator=gen), torch.randint(0, 10, (24,), generator=gen)
            fleet.train_step(x, y, nn.CrossEntropyLoss())
        return fleet.strategy.state_dicts()[0]

    want, got = job("serial"), job("mp", devices="cpu,cpu", microbatches=3)
    # Given stages are kept as one Sequential of them: keys are "stage.layer.name".
    assert list(got) == ["0.1.weight", "0.1.bias", "1.3.weight", "1.3.bias", "1.5.weight", "1.5.bias"]
    for (key, a), b in zip(got.items(), want.values(), strict=True):
        assert (a - b).abs().max().item() < TOL, key


def test_sequential_is_cut_balanced_by_parameters():
    assert balanced_split([0, 8320, 0, 16512, 0, 1290], 2) == [2, 4]  # 8,320 | 17,802
    assert balanced_split([5, 5, 5, 5], 4) == [1, 1, 1, 1]
    assert balanced_split([1, 1, 1, 10], 2) == [3, 1]
    stages = split_sequential(cnn(), 2)
    sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert [len(s) for s in stages] == [3, 6] and sizes == [18_816, 132_490]
    model = mlp()
    assert [m for s in split_sequential(model, 3) for m in s] == list(model)  # consecutive, shared


def test_microbatches_flow_stage_by_stage():
    calls = []

    class Tap(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def forward(self, x):
            calls.append((self.name, len(x)))
            return x + 1

    pipe = MicroBatchPipe([Tap("a"), Tap("b")], [torch.device("cpu")] * 2, microbatches=3)
    out = pipe(torch.zeros(7, 2))
    assert torch.equal(out, torch.full((7, 2), 2.0))
    # A wavefront: b takes micro-batch i while a takes i+1 (later stage first).
    assert calls == [("a", 3), ("b", 3), ("a", 2), ("b", 2), ("a", 2), ("b", 2)]


def test_dp_wraps_and_says_once_it_has_nothing_to_split():
    fleet = torchfleet.Fleet(strategy="dp")
    model, _ = fleet.setup(mlp(), None)
    assert isinstance(model, nn.DataParallel) and fleet.strategy.unwrapped() is model.module
    gpus = torch.cuda.device_count()
    if gpus < 2:
        assert [n for n in fleet.notes if "nothing to split" in n] == [
            f"dp splits each batch across GPUs and {gpus} {'is' if gpus == 1 else 'are'} visible,"
            f" so nn.DataParallel has nothing to split; running on {fleet.device} alone"
        ]
        assert fleet.strategy.chunk_sizes(64) == [64]


def test_dp_scatter_chunk_sizes():
    # DataParallel's scatter cuts with Tensor.chunk: ceil-sized chunks, the last one smaller,
    # and fewer chunks than GPUs when the batch is small (fewer replicas are used).
    assert scatter_sizes(64, 2) == [32, 32]
    assert scatter_sizes(64, 3) == [22, 22, 20]
    assert scatter_sizes(10, 4) == [3, 3, 3, 1]
    assert scatter_sizes(5, 4) == [2, 2, 1]
    assert scatter_sizes(64, 1) == [64]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel's real scatter needs 2 or more GPUs")
def test_dp_scatter_matches_torch_on_gpus():
    from torch.nn.parallel.scatter_gather import scatter

    gpus = list(range(torch.cuda.device_count()))
    for batch in (64, 10, 5):
        chunks = scatter(torch.zeros(batch, 3, device="cuda:0"), gpus)
        assert [len(c) for c in chunks] == scatter_sizes(batch, len(gpus))


BAD = [
    ({"devices": "cpu,gpu"}, "device 'gpu' in --devices is not a device name"),
    ({"devices": "cuda:7"}, "device cuda:7 in --devices is not visible here"),
    ({"devices": "meta"}, "device meta in --devices is neither cpu nor cuda"),
    ({"microbatches": 0}, "--microbatches 0 must be a whole number, at least 1"),
    ({"schedule": "gpipe"}, "option 'schedule' does not apply to strategy 'mp'"),
]


@pytest.mark.parametrize("options,sentence", BAD, ids=[s for _, s in BAD])
def test_mp_bad_options(options, sentence):
    with pytest.raises(UsageError, match=sentence):
        torchfleet.Fleet(strategy="mp", **options)


def test_mp_bad_models():
    fleet = torchfleet.Fleet(strategy="mp", devices="cpu,cpu,cpu")
    with pytest.raises(UsageError, match="the model has 2 layers, too few for 3 stages"):
        fleet.setup(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), None)
    with pytest.raises(UsageError, match="mp was given 2 stages for 3 devices"):
        fleet.setup([nn.Linear(2, 2), nn.Linear(2, 2)], None)
    with torch.device("meta"), pytest.raises(UsageError, match="need the whole model as one nn.Module"):
        fleet.setup([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)], None)
    with pytest.raises(
        UsageError,
        match=r"cannot cut this Linear into 3 stages automatically: it has 0"
        r" repeated blocks \(none\); pass split_points",
    ):
        fleet.setup(nn.Linear(2, 2), None)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,flags", [("dp", []), ("mp", ["--devices", "cpu,cpu", "--microbatches", "2"])])
def test_train_from_the_command_line(tmp_path, strategy, flags):
    from helpers import torchfleet as cli

    out = tmp_path / "result.json"
    result = cli(
        "train",
        "--strategy",
        strategy,
        *flags,
        "--model",
        "mlp",
        "--epochs",
        "1",
        "--max-steps",
        "8",
        "--no-progress",
        "--json-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    import json

    figures = json.loads(out.read_text())
    assert figures["strategy"] == strategy and figures["world_size"] == 1 and figures["steps"] == 8
    assert figures["samples_per_s"] > 0 and figures["val_accuracy"] > 0.3  # 8 steps: well above chance
    assert result.stdout.count("note: ") == 1  # said once: no second GPU / stages share the CPU


@pytest.mark.parametrize("strategy", ["hsdp", "fsdp+pipeline", "ddp+pipeline"])
def test_a_two_dimensional_preset_in_one_process_runs_as_serial(strategy):
    fleet = torchfleet.Fleet(strategy=strategy)
    assert fleet.strategy_name == "serial"
    assert fleet.notes == [f"{strategy} with one process has nothing to share; running it as serial"]
