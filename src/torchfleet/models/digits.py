"""The small built-in classifiers, each an ``nn.Sequential`` of plain layers.

Sequential on purpose: the model-parallel and pipeline strategies cut a
Sequential into consecutive stages, and no layer keeps per-batch statistics
(no BatchNorm), so a data-parallel run computes exactly what a single process
computes on the same global batch. They are sized for scikit-learn's 8x8
digits (any HxW works).
"""

from __future__ import annotations

import math

import torch
from torch import nn

DIGITS_INPUT = (1, 8, 8)  # the built-in data's images, and the bench's mock batches for these models


def mlp(in_shape: tuple[int, ...] = DIGITS_INPUT, num_classes: int = 10, hidden: int = 128) -> nn.Sequential:
    features = math.prod(in_shape)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def cnn(in_shape: tuple[int, ...] = DIGITS_INPUT, num_classes: int = 10, width: int = 32) -> nn.Sequential:
    """Two 3x3 convolutions and a 2x2 pool, sized for 8x8 digits (any HxW works)."""
    channels, height, width_px = in_shape
    flat = (width * 2) * (height // 2) * (width_px // 2)
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width * 2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


class _RowsAsTokens(nn.Module):
    """(N, C, H, W) images as N sequences of H tokens (rows) of C*W features."""

    def forward(self, x):
        n, c, h, w = x.shape
        return x.permute(0, 2, 1, 3).reshape(n, h, c * w)


class _AddPosition(nn.Module):
    def __init__(self, length: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, length, dim) * 0.02)

    def forward(self, x):
        return x + self.weight


class _MeanOverTokens(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


def transformer(
    in_shape: tuple[int, ...] = DIGITS_INPUT, num_classes: int = 10, dim: int = 64, layers: int = 2, heads: int = 4
) -> nn.Sequential:
    """A small encoder classifier: each image row is a token. No dropout, so every
    strategy computes the same function as serial."""
    channels, height, width_px = in_shape
    blocks = [
        nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        for _ in range(layers)
    ]
    return nn.Sequential(
        _RowsAsTokens(),
        nn.Linear(channels * width_px, dim),
        _AddPosition(height, dim),
        *blocks,
        nn.LayerNorm(dim),
        _MeanOverTokens(),
        nn.Linear(dim, num_classes),
    )
