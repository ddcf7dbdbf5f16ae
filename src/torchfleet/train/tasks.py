"""What each built-in model learns: its loss, and the validation figures the trainer reports.

A classifier (mlp, cnn, transformer, the ResNets) is scored by accuracy. A
token model (gpt) predicts the next token at every position, so it is scored
by the mean loss per token and its exponential, the perplexity (how many
tokens the model is, in effect, choosing among). Both figures are ratios of
sums over samples: each rank tallies its share of the validation set as
(correct, samples) or (summed token loss, tokens), one all-reduce adds the
tallies, and the ratio is taken once, so every sample counts once whatever
the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchfleet.models import TOKEN_MODELS, lm_loss
from torchfleet.train.own_model import logits_of


@dataclass(frozen=True)
class Task:
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    tally: Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]  # one batch: (numerator, count)
    figures: Callable[[float, float], dict]  # the summed tallies -> the result's validation entries


def _correct(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    return float((outputs.argmax(-1).cpu() == targets.cpu()).sum()), float(targets.numel())


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    # fp32 and summed: bf16 logits, or a mean of means over batches of unequal size, would skew it.
    summed = F.cross_entropy(logits.float().flatten(0, -2), targets.to(logits.device).flatten(), reduction="sum")
    return summed.item(), float(targets.numel())


def _accuracy(correct: float, total: float) -> dict:
    return {"val_accuracy": correct / total if total else float("nan")}


def _loss_and_perplexity(loss_sum: float, tokens: float) -> dict:
    mean = loss_sum / tokens if tokens else float("nan")
    # torch's exp, not math's: a diverged loss gives inf (math.exp raises) and NaN stays NaN.
    return {"val_loss": mean, "val_perplexity": torch.tensor(mean, dtype=torch.float64).exp().item()}


def padded_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """lm_loss for padded samples (targets -100 at the padding): summed over the tokens that have a target and
    divided by every position, padding included. A mean over the targets alone would divide each rank's sum by
    its own count of them, and the ranks' mean would then not be serial's loss (0.03 apart in the weights after
    14 steps of gpt tiny on documents); with every position counted, a rank's denominator is its share of the
    global batch's, as for unpadded data, and ddp and fsdp equal serial again."""
    summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
    return summed / targets.numel()


CLASSIFY = Task(nn.CrossEntropyLoss(), _correct, _accuracy)
LANGUAGE = Task(lm_loss, _token_loss, _loss_and_perplexity)
PADDED_LANGUAGE = Task(padded_lm_loss, _token_loss, _loss_and_perplexity)  # --data documents (data/text_records.py)
# The user's language model (train --hf-model, --model MODULE:FUNCTION): its logits, or a transformers output's.
OWN_LANGUAGE = Task(
    lambda out, y: lm_loss(logits_of(out), y), lambda out, y: _token_loss(logits_of(out), y), _loss_and_perplexity
)


def task_for(model: str, padded: bool = False) -> Task:
    """The model's task; `padded`: its samples are padded, with targets -100 there (documents)."""
    if model not in TOKEN_MODELS:
        return CLASSIFY
    return PADDED_LANGUAGE if padded else LANGUAGE


@torch.no_grad()
def validate(model: nn.Module, dataset, task: Task, batch_size: int = 512) -> dict:
    """`task`'s validation figures for `model` over `dataset`, in one process (hogwild's parent)."""
    was_training = model.training
    model.eval()
    numerator = count = 0.0
    for inputs, targets in torch.utils.data.DataLoader(dataset, batch_size=batch_size):
        n, c = task.tally(model(inputs), targets)
        numerator, count = numerator + n, count + c
    model.train(was_training)
    return task.figures(numerator, count)
