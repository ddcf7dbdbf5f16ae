"""BatchNorm under every strategy: synchronised statistics give serial's weights; the others are said.

The distributed checks run real processes over Gloo on CPU (`torchfleet.launch`), where torch's
own nn.SyncBatchNorm refuses to run.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import torchfleet as cli
from torchfleet import UsageError, launch
from torchfleet.cli import _strategy_options, build_parser
from torchfleet.fleet import Fleet
from torchfleet.strategies.batchnorm import SyncBatchNorm, batchnorm_note, convert_sync_batchnorm
from torchfleet.testing.equivalence import full_weights
from torchfleet.testing.real_models import train_resnet
from torchfleet.train.datasets import synthetic
from torchfleet.train.models import build_optimizer

OPTIMIZERS = [("sgd", 0.05), ("adamw", 1e-3)]


def bn_cnn() -> nn.Sequential:
    """A convolution and a linear layer, each followed by BatchNorm (2d, then 1d), for 8x8 digits.

    No bias before a BatchNorm, as in ResNets: BatchNorm subtracts it again, so its gradient is
    float noise around 0, which AdamW scales up to full steps of lr in whatever direction the
    noise points (4e-3 apart from serial after 5 steps with such biases, measured).
    """
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 32, bias=False),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def _train(strategy: str, optimizer: str, lr: float, steps: int = 5, batch_size: int = 32, **options):
    """(weights and running statistics after `steps` steps on the main rank, the fleet's notes)."""
    fleet = Fleet(strategy=strategy, **options)
    torch.manual_seed(0)
    net = bn_cnn()
    fleet.setup(net, build_optimizer(optimizer, net.parameters(), lr))
    for inputs, targets in fleet.dataloader(synthetic(batch_size * steps, shape=(1, 8, 8), seed=0), batch_size, seed=0):
        fleet.train_step(inputs, targets, nn.functional.cross_entropy)
    return full_weights(fleet), list(fleet.notes)


def _layer_cases():
    """(a BatchNorm, an input for it): every kind, and momentum=None's cumulative average."""
    return [
        (nn.BatchNorm1d(6), torch.randn(8, 6) * 3 + 1),
        (nn.BatchNorm1d(6), torch.randn(8, 6, 5)),
        (nn.BatchNorm2d(4, momentum=None), torch.randn(8, 4, 5, 5) + 2),
        (nn.BatchNorm3d(3, affine=False), torch.randn(8, 3, 2, 3, 3)),
    ]


def _layer_differences() -> float:
    """SyncBatchNorm on this rank's half of a batch vs nn.BatchNorm on all of it, over 3 steps:
    outputs, input gradients, parameter gradients (summed over ranks) and running statistics,
    each relative to its own size (gradients of a summed loss reach 40 here)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same batch on both ranks
    worst = 0.0
    for case, (bn, x) in enumerate(_layer_cases()):
        torch.manual_seed(case)
        if bn.affine:
            nn.init.normal_(bn.weight)
            nn.init.normal_(bn.bias)
        synced = convert_sync_batchnorm(copy.deepcopy(bn))
        for step in range(3):
            x = x + step
            weights = torch.randn_like(x)  # a loss that weighs every output differently
            whole = x.clone().requires_grad_()
            want = bn(whole)
            (want * weights).sum().backward()
            mine = x.chunk(world)[rank].clone().requires_grad_()
            got = synced(mine)
            (got * weights.chunk(world)[rank]).sum().backward()
            pairs = [
                (got.detach(), want.detach().chunk(world)[rank]),
                (mine.grad, whole.grad.chunk(world)[rank]),
                (synced.running_mean, bn.running_mean),
                (synced.running_var, bn.running_var),
            ]
            for p, q in zip(synced.parameters(), bn.parameters(), strict=True):
                grad = p.grad.clone()
                dist.all_reduce(grad)
                pairs.append((grad, q.grad))
            worst = max(worst, *((a - b).abs().max().item() / max(1.0, b.abs().max().item()) for a, b in pairs))
            assert synced.num_batches_tracked.item() == bn.num_batches_tracked.item() == step + 1
    return worst


def _ddp_job() -> list:
    results = [_train("ddp", opt, lr, sync_batchnorm=True) for opt, lr in OPTIMIZERS]
    results.append(_train("ddp", "sgd", 0.05))
    results.append(_layer_differences())  # in the process group Fleet started
    dist.barrier()  # see Fleet.close: tear down together
    dist.destroy_process_group()
    return results


def _fsdp_job() -> list:
    results = [_train("fsdp", opt, lr, sync_batchnorm=True) for opt, lr in OPTIMIZERS]
    dist.barrier()
    dist.destroy_process_group()
    return results


def _max_difference(got, want) -> float:
    assert got.shape == want.shape
    return (got - want).abs().max().item()


@pytest.mark.timeout(120)
def test_ddp_with_sync_batchnorm_equals_serial_and_without_it_does_not():
    serial = [_train("serial", opt, lr)[0] for opt, lr in OPTIMIZERS]
    *synced, (unsynced, notes), layer = launch(_ddp_job, nprocs=2)[0]
    # Float rounding only (4e-7 measured); a wrong statistic or gradient is off by 1e-1.
    assert layer < 2e-6, f"SyncBatchNorm vs nn.BatchNorm on the whole batch: {layer:.3g} (relative)"
    for (opt, _), want, (got, got_notes) in zip(OPTIMIZERS, serial, synced, strict=True):
        # Weights, running means and variances, num_batches_tracked: the whole state dict.
        diff = _max_difference(got, want)
        print(f"ddp --sync-batchnorm, {opt}: max difference from serial {diff:.3g}")
        assert diff < 1e-5, f"ddp --sync-batchnorm, {opt}: max difference from serial {diff:.3g}"
        assert any("all-reduced across the data-parallel processes" in n for n in got_notes)
    # Each process normalising its own 16 samples: 0.040 measured here (torch 2.14, SGD).
    apart = _max_difference(unsynced, serial[0])
    print(f"ddp without --sync-batchnorm, sgd: max difference from serial {apart:.3g}")
    assert apart > 1e-3, apart
    assert [n for n in notes if "BatchNorm" in n] == [
        "BatchNorm under ddp normalises each process's share of the batch with that share's statistics;"
        " pass --sync-batchnorm (sync_batchnorm=True) to normalise with the whole batch's, as serial does"
    ]


@pytest.mark.timeout(120)
def test_fsdp_with_sync_batchnorm_equals_serial():
    serial = [_train("serial", opt, lr)[0] for opt, lr in OPTIMIZERS]
    for (opt, _), want, (got, _) in zip(OPTIMIZERS, serial, launch(_fsdp_job, nprocs=2)[0], strict=True):
        diff = _max_difference(got, want)
        print(f"fsdp --sync-batchnorm, {opt}: max difference from serial {diff:.3g}")
        assert diff < 1e-5, f"fsdp --sync-batchnorm, {opt}: max difference from serial {diff:.3g}"


def test_conversion_keeps_parameters_buffers_and_names():
    model = bn_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.state_dict(keep_vars=True)
    params = [id(p) for p in model.parameters()]
    assert convert_sync_batchnorm(model) is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[6], SyncBatchNorm)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)  # same keys, same order
    assert all(after[k] is before[k] for k in before)  # the same tensors, buffers included
    assert [id(p) for p in model.parameters()] == params
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == params
    with pytest.raises(ValueError, match="expected 2D or 3D input"):  # BatchNorm1d's own shape check
        model[6](torch.randn(2, 32, 1, 1))
    assert convert_sync_batchnorm(model)[1] is model[1]  # already synchronised: left alone
    root = convert_sync_batchnorm(nn.BatchNorm1d(3))
    assert isinstance(root, SyncBatchNorm)


def test_a_lazy_batchnorm_before_its_first_forward_is_one_sentence():
    with pytest.raises(UsageError, match="LazyBatchNorm1d has not seen an input yet") as info:
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("train_mode", [False, True])
def test_without_other_processes_it_is_nn_batchnorm_exactly(train_mode):
    """Eval mode, or training with no process group: the same call, bit for bit."""
    for bn, x in _layer_cases():
        bn.running_mean.uniform_(-1, 1)  # running statistics unlike a fresh layer's
        bn.running_var.uniform_(0.5, 2)
        bn.train(train_mode)
        synced = convert_sync_batchnorm(copy.deepcopy(bn))
        for _ in range(2):
            assert torch.equal(synced(x), bn(x))
        assert torch.equal(synced.running_mean, bn.running_mean)
        assert torch.equal(synced.running_var, bn.running_var)


def test_the_note_says_which_statistics_once():
    fleet = Fleet(strategy="dp")
    net = bn_cnn()
    for _ in range(2):
        fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert len([n for n in fleet.notes if "BatchNorm" in n]) == 1
    assert "nn.DataParallel's replicas normalise each GPU's chunk" in fleet.notes[-1]
    assert batchnorm_note(bn_cnn(), "serial", False) is None  # the reference: nothing to say
    assert batchnorm_note(nn.Linear(2, 2), "ddp", False) is None
    assert "each micro-batch" in batchnorm_note([nn.Linear(2, 2), nn.BatchNorm1d(2)], "mp", False)
    assert "each micro-batch" in batchnorm_note(bn_cnn(), "ddp+pipeline", False)
    assert "each worker" in batchnorm_note(bn_cnn(), "hogwild", False)


def test_the_flag_reaches_the_strategy_options():
    parser = build_parser()
    assert _strategy_options(parser.parse_args(["train", "--sync-batchnorm"])) == {"sync_batchnorm": True}
    assert "sync_batchnorm" not in _strategy_options(parser.parse_args(["train"]))


def test_a_pipeline_refuses_sync_batchnorm_in_one_sentence():
    result = cli("train", "--strategy", "pipeline", "-n", "2", "--sync-batchnorm", "--no-progress", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "torchfleet train: error: --sync-batchnorm does not apply to a pipeline (pp 2): each stage normalises"
        " one micro-batch at a time, so there are no whole-batch statistics to synchronise; drop"
        " --sync-batchnorm, or use ddp or fsdp without --pp"
    ]


@functools.lru_cache(maxsize=1)
def _resnet_serial_float64() -> dict:
    from torchfleet.testing.real_models import train_resnet

    return train_resnet("serial", float64=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resnet18_with_synchronised_statistics_equals_serial(strategy):
    """The built-in resnet18 (torchvision's module tree, 20 BatchNorm layers): with
    sync_batchnorm every layer normalises with the whole batch's statistics, as serial does.

    Both sides run in float64. These 5 steps on random images magnify a difference about
    tenfold a step (layer4 normalises 1x1 maps): in fp32 the two processes ended 5.4e-7 from
    serial on one machine and 5.5e-4 on another (an AMD EPYC, 2.2e-6 after 2 steps, 2.7e-5
    after 3), where serial's own fp32 run ended 4e-5 from float64. In float64 the rounding
    they magnify is 1e-16.
    """
    want = _resnet_serial_float64()
    got = launch(functools.partial(train_resnet, sync_batchnorm=True, float64=True), nprocs=2, args=(strategy,))[0]
    assert set(got) == set(want)
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    print(f"{strategy}: max difference {diff:.3g} from serial in float64")
    assert diff < 1e-9, f"{strategy}: max difference {diff:.3g} from serial (weights and running statistics)"
