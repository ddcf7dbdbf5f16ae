"""The built-in job of `torchfleet train`: its data, model and optimizer set up by Fleet, and its validation."""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch.utils.data import Dataset

from torchfleet.data import GlobalBatchSampler
from torchfleet.data.stream import StreamLoader
from torchfleet.fleet import Fleet
from torchfleet.models import gpt_config
from torchfleet.models.user import is_user_model
from torchfleet.strategies.expert_load import ExpertLoad
from torchfleet.train import own_model
from torchfleet.train.config import TrainConfig
from torchfleet.train.datasets import builtin_dataset, path_datasets
from torchfleet.train.models import build_model, build_optimizer
from torchfleet.train.tasks import CLASSIFY, OWN_LANGUAGE, Task, task_for

DOCUMENT_WORKERS = 1  # loader workers per rank tokenizing --data documents (docs/benchmarks: what 2 give)


def evaluate(fleet: Fleet, dataset, on_batch=None, task: Task = CLASSIFY) -> dict:
    """`task`'s validation figures over the whole validation set, each sample counted once
    across ranks: {"val_accuracy": ...}, or val_loss and val_perplexity for gpt (train/tasks.py)."""
    if dataset is None:  # --data PATH without validation files: nothing to report
        return {}
    model = fleet.strategy.model
    was_training = model.training
    model.eval()
    numerator = count = 0.0
    for inputs, targets in fleet.eval_dataloader(dataset):
        outputs = fleet.predict(inputs)
        if on_batch:
            on_batch()  # the watchdog's heartbeat: a long evaluation is progress too
        if outputs is not None:  # pipeline stages other than the last return None
            n, c = task.tally(outputs, targets)
            numerator, count = numerator + n, count + c
    model.train(was_training)
    sums = fleet.all_reduce(torch.tensor([numerator, count], dtype=torch.float64), op="sum")
    return task.figures(sums[0].item(), sums[1].item())


@dataclasses.dataclass
class Job:
    """The built-in job, set up by Fleet: what the loop trains and evaluates."""

    optimizer: torch.optim.Optimizer
    task: Task
    loader: torch.utils.data.DataLoader | StreamLoader
    sampler: GlobalBatchSampler | StreamLoader  # the position a checkpoint holds; a stream's loader keeps its own
    val_set: torch.utils.data.Dataset | None
    block: int  # a gpt sample's tokens
    expert_load: ExpertLoad | None  # tokens per expert, for a model with experts


def set_up(cfg: TrainConfig, fleet: Fleet, given: torch.nn.Module | None = None) -> Job:
    """The built-in job's data, model and optimizer, set up by `fleet` for its strategy. `given`: the model to
    train instead of building it (hogwild's workers share one, built by their parent as below)."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
    block = gpt_config(cfg.gpt_preset).block_size  # read by --data text and PATH only
    assert cfg.data is not None  # TrainConfig.__post_init__ puts the model's default there
    weights, own = None, cfg.hf_model is not None or is_user_model(cfg.model)
    if own:  # the user's language model, built on the meta device; no longer context than it takes
        model, weights, context = own_model.build(fleet, cfg.hf_model, cfg.model)
        block = min(block, context) if context else block
    transform, train_set = None, None
    if cfg.data_path:  # the user's tokens: checked against the model's vocabulary on the way
        vocab = own_model.vocabulary(model) if own else gpt_config(cfg.gpt_preset).vocab_size
        train_set, val_set, transform = path_datasets(cfg.data, cfg.tokenizer, block, vocab)
        in_shape = (block,)
    else:
        train_set = builtin_dataset(cfg.data, "train", cfg.seed, cfg.synthetic_size, block_size=block)
        val_set = builtin_dataset(cfg.data, "val", cfg.seed, cfg.synthetic_size, block_size=block)
        in_shape = tuple(train_set[0][0].shape)
    if given is not None:
        model = given
    elif not own:
        model = build_model(cfg.model, in_shape, num_classes=10, gpt_preset=cfg.gpt_preset)
    # the loss, and what validation reports
    task = OWN_LANGUAGE if own else task_for(cfg.model, padded=transform is not None)
    # A meta model's optimizer is not fused: torch's fused AdamW refuses parameters on the meta device.
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr, None if own else fleet.device)
    # Documents are tokenized in a loader worker, never on the training thread.
    workers = DOCUMENT_WORKERS if transform is not None else 0
    loader = fleet.dataloader(
        train_set, cfg.batch_size, shuffle=True, seed=cfg.seed, num_workers=workers, transform=transform
    )
    sampler = loader if isinstance(loader, StreamLoader) else loader.batch_sampler
    assert isinstance(sampler, (GlobalBatchSampler, StreamLoader))  # fleet.dataloader's own: local_batch, state
    # A batch of this rank's shape, for pipelines that trace the model to cut it. Made from
    # the data set, not the loader: a loader's iterator draws from its shuffling generator.
    # The user's tokens: zeros of that shape (token 0 is in every vocabulary; a stream's first
    # batch would be read twice).
    if cfg.data_path:
        example = torch.zeros(sampler.local_batch, block, dtype=torch.long)
    else:
        built_in = cast(Dataset, train_set)  # digits, synthetic, text: (input, target) pairs
        example = torch.stack([built_in[i][0] for i in range(sampler.local_batch)])
    _, optimizer = fleet.setup(model, optimizer, example_inputs=example, weights=weights)
    expert_load = fleet.expert_load  # Fleet counts a model's experts (None without)
    for note in fleet.notes:  # after setup: the BatchNorm note needs the model
        fleet.print(f"note: {note}")
    return Job(optimizer, task, loader, sampler, val_set, block, expert_load)
