"""The hot path is as fast as hand-written code and computes exactly what it computes.

benchmarks/parity.py measures the speed; these check the "exactly": the
whole-batch gather against DataLoader's per-sample fetch, and train_step
against a hand-written loop, bit for bit.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from torchfleet.data import GlobalBatchSampler, TensorBatches
from torchfleet.fleet import Fleet
from torchfleet.train.datasets import digits, synthetic
from torchfleet.train.models import cnn


def test_whole_batch_gather_equals_per_sample_fetch():
    fleet = Fleet("serial")
    for data in (synthetic(1000, shape=(1, 8, 8), seed=3), digits("val")):
        fast = fleet.dataloader(data, 64, shuffle=True, seed=5)
        assert isinstance(fast.dataset, TensorBatches)
        slow = DataLoader(data, batch_sampler=GlobalBatchSampler(len(data), 64, 0, 1, True, 5))
        pairs = list(zip(fast, slow, strict=True))
        assert len(pairs) == len(data) // 64
        for (x, y), (x_ref, y_ref) in pairs:
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)  # same samples, same order
            assert x.dtype == x_ref.dtype and y.dtype == y_ref.dtype and x.is_contiguous()


def test_other_datasets_keep_the_default_fetch():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.tensor([float(i * i)]), i

    loader = Fleet("serial").dataloader(Squares(), 5, shuffle=False)
    assert [y.tolist() for _, y in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_train_step_equals_a_hand_written_loop_bit_for_bit():
    torch.manual_seed(0)
    initial = cnn()
    data = synthetic(6 * 32, seed=1)
    loss_fn = nn.CrossEntropyLoss()

    hand = copy.deepcopy(initial)
    opt = torch.optim.SGD(hand.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in DataLoader(data, batch_size=32):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(hand(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    fleet = Fleet("serial")
    model = copy.deepcopy(initial)
    fleet.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    got = [fleet.train_step(x, y, loss_fn) for x, y in fleet.dataloader(data, 32, shuffle=False)]
    assert all(torch.equal(a, b) for a, b in zip(got, losses, strict=True))
    for (name, a), b in zip(hand.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


# -- the loss reaches the host once per log interval (train/losses.py) -----------------------

SYNCS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")  # each waits for the GPU


def _host_reads(monkeypatch, **options) -> int:
    """Host reads of tensors made by torchfleet's own code during a serial `train` of the built-in job.

    On a CPU nothing waits, but a read here is a wait there: the calls are
    counted by name, from torchfleet's files only (torch's optimizers read
    their own step counters, which live on the CPU even with a GPU).
    """
    import sys
    from pathlib import Path

    import torchfleet
    from torchfleet.train.config import TrainConfig
    from torchfleet.train.loop import train

    package = str(Path(torchfleet.__file__).parent)
    count = [0]

    def counted(original):
        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(package):
                count[0] += 1
            return original(self, *args, **kwargs)

        return read

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    train(
        TrainConfig(
            model="mlp", data="synthetic", synthetic_size=2048, batch_size=32, epochs=1, hang_timeout=0, **options
        ),
        "serial",
    )
    return count[0]


def test_the_loss_reaches_the_host_once_per_log_interval(monkeypatch):
    def per_step(log_every):  # the difference of two runs: evaluation and the summary cancel out
        short = _host_reads(monkeypatch, max_steps=10, log_every=log_every)
        long = _host_reads(monkeypatch, max_steps=30, log_every=log_every)
        return (long - short) / 20

    # The loop used to read twice per step: loss.item() for the bar, isfinite(loss).item().
    assert per_step(1) == 1.0  # one read, of the loss and its finiteness together
    assert per_step(5) == 0.2  # steps 15, 20, 25, 30 against 10: 4 reads in 20 steps
    assert per_step(10) == 0.1


def test_a_nan_between_reads_is_named_by_its_step(monkeypatch, tmp_path, capsys):
    from torchfleet import cli

    monkeypatch.setenv("TORCHFLEET_FAULT", "nan:rank=0:step=7")  # faults.py: step 7's loss becomes NaN
    code = cli.main(
        [
            "train",
            "--strategy",
            "serial",
            "--model",
            "mlp",
            "--data",
            "synthetic",
            "--synthetic-size",
            "2048",
            "--batch-size",
            "32",
            "--max-steps",
            "30",
            "--log-every",
            "5",
            "--checkpoint-every",
            "10",
            "--no-progress",
            "--hang-timeout",
            "0",
            "--checkpoint-dir",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "torchfleet train: error: the loss is nan at step 7 on rank 0; training stopped at step 10, which read"
        " the losses of steps 6-10 together (--log-every 5) (lower --lr, or use --precision fp32 if it was bf16)"
    ]
    assert not list(tmp_path.iterdir())  # step 10's checkpoint was not saved: the read came first


class _Scaler:  # what the window asks of torch's GradScaler
    def get_scale(self):
        return 256.0


def test_fp16_skipped_steps_are_counted_across_reads():
    from torchfleet.errors import TrainingError
    from torchfleet.train.losses import FP16_NONFINITE_LIMIT, LossWindow

    window = LossWindow(4, rank=1, scaler=_Scaler())
    nan = torch.tensor(float("nan"))
    for step, loss in enumerate([1.0, 3.0, nan, 2.0], start=1):  # a skipped step is routine under fp16
        window.add(torch.as_tensor(loss), step)
    assert window.read() == 2.0  # the mean of the finite losses
    assert window.read() is None  # nothing since
    with pytest.raises(TrainingError) as caught:
        for step in range(5, 5 + 2 * FP16_NONFINITE_LIMIT):
            window.add(nan, step)
            if step % 4 == 0:  # reads at 8 and 12: the run of NaNs spans both
                window.read()
    assert str(caught.value).startswith(
        f"the loss has been nan for {FP16_NONFINITE_LIMIT} steps in a row up to step {4 + FP16_NONFINITE_LIMIT} on"
        " rank 1, though the fp16 scaler skipped each one and lowered its scale to 256; training stopped"
    )
