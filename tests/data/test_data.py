"""What fleet.dataloader yields: one batch taken for example_inputs changes nothing; a checkpoint's position resumes."""

import torch

from torchfleet.data import GlobalBatchSampler
from torchfleet.fleet import Fleet
from torchfleet.train.datasets import synthetic


def test_a_batch_taken_for_example_inputs_leaves_the_epoch_whole():
    fleet = Fleet("serial")
    data = synthetic(256, shape=(1, 8, 8), seed=1)
    loader = fleet.dataloader(data, 32, shuffle=True, seed=2)
    example = next(iter(loader))[0]  # the README's way to get example_inputs for a pipeline
    epoch = [x for x, _ in loader]
    untouched = [x for x, _ in fleet.dataloader(data, 32, shuffle=True, seed=2)]
    assert len(epoch) == len(untouched) == 8  # batch 0 is not skipped
    assert all(torch.equal(a, b) for a, b in zip(epoch, untouched, strict=True))
    assert torch.equal(example, epoch[0])
    second = [x for x, _ in loader]  # a finished pass moves on to the next epoch's order
    assert len(second) == 8 and not torch.equal(second[0], epoch[0])


def test_a_loaded_position_resumes_mid_epoch_once():
    straight = list(GlobalBatchSampler(100, 10, shuffle=True, seed=0))
    stopped = GlobalBatchSampler(100, 10, shuffle=True, seed=0)
    it = iter(stopped)
    for _ in range(3):
        next(it)
    state = stopped.state_dict()
    assert state == {"epoch": 0, "position": 3, "seed": 0}
    resumed = GlobalBatchSampler(100, 10, shuffle=True, seed=0)
    resumed.load_state_dict(state)
    assert list(resumed) == straight[3:]  # the checkpoint's position, then the rest of the epoch
    assert resumed.epoch == 1 and resumed.position == 0


def test_seek_moves_the_pass_under_way_and_the_next_one():
    """A replica group's step that did not commit reads the same batch again; a group that healed reads its
    peers' step's batch, in this epoch (the pass under way) or another (the next pass starts there)."""
    from torchfleet.data import GlobalBatchSampler

    sampler = GlobalBatchSampler(40, 10, shuffle=False)  # 4 steps an epoch; a batch's first index is 10 x step
    it = iter(sampler)
    seen = [next(it)[0], next(it)[0]]  # steps 0 and 1
    sampler.seek(1)  # step 1 did not commit: again
    seen += [next(it)[0], next(it)[0]]
    assert seen == [0, 10, 10, 20]
    sampler.seek(6)  # healed to step 6: epoch 1, batch 2
    assert list(it) == [] and (sampler.epoch, sampler.position) == (1, 2)
    assert [b[0] for b in sampler] == [20, 30] and sampler.epoch == 2
    assert [b[0] for b in sampler] == [0, 10, 20, 30]  # a pass with no seek starts at 0
    it = iter(sampler)
    last = [next(it)[0] for _ in range(4)]
    sampler.seek(sampler.epoch * 4 + 3)  # the epoch's last step did not commit
    assert last + [b[0] for b in it] == [0, 10, 20, 30, 30] and sampler.epoch == 4


def test_the_built_in_data_is_scikit_learns_read_without_importing_it():
    # Workers read the files scikit-learn ships instead of importing sklearn.datasets (1.5 s of a core each);
    # what they read must be exactly what its loaders return.
    import importlib.resources
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from torchfleet.train.datasets import digits, digits_arrays
    from torchfleet.train.text import corpus

    pixels, labels = digits_arrays()
    want_pixels, want_labels = load_digits(return_X_y=True)
    assert torch.equal(pixels, torch.tensor(want_pixels, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(want_labels)) and labels.dtype == torch.int64
    assert len(digits("train")) + len(digits("val")) == 1797
    files = sorted(
        (f for f in importlib.resources.files("sklearn.datasets.descr").iterdir() if f.name.endswith(".rst")),
        key=lambda f: f.name,
    )
    assert corpus() == b"".join(f.read_bytes().rstrip(b"\n") + b"\n\n" for f in files)
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from torchfleet.train.datasets import digits, text;"
            " digits(); text('train', 64); print(sorted(m for m in sys.modules if m.startswith('sklearn')))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.stdout.strip() == "[]", imported.stderr
