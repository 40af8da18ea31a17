"""The pipelining tutorial's MNIST network: four blocks, the loss in the last.

Used by the script, the notebooks, the benchmarks and the tests, so they all
train the same model. ``Network(split=...)`` places the blocks on virtual IPUs
for the explorer; the default names the blocks B1–B4 as the tutorial does.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..core.blocks import Block
from ..core.strategies import PipelinedExecution, ShardedExecution, Stage

BLOCKS = ("B1", "B2", "B3", "B4")


class ConvLayer(nn.Module):
    """Convolution, max-pool, ReLU."""

    def __init__(self, in_channels: int, num_filters: int, kernel_size: int, pool_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    """The tutorial's network, one Block per layer group (B1–B4)."""

    def __init__(self):
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)

    def forward(self, x):
        with Block("B1"):
            x = self.layer1(x)
        with Block("B2"):
            x = self.layer2(x)
        with Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
        with Block("B4"):
            x = self.layer4(x)
        return x


class TrainingModelWithLoss(nn.Module):
    """The network plus cross-entropy, computed in block B4 (the last stage)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        with Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def strategy(split: Optional[Sequence[int]] = None, sharded: bool = False):
    """A strategy placing blocks B1–B4 on IPUs ``split`` (default: one IPU each).

    ``split=(0, 0, 1, 1)`` puts B1, B2 on IPU 0 and B3, B4 on IPU 1. IPU ids
    must not decrease along the model.
    """
    split = tuple(range(len(BLOCKS))) if split is None else tuple(split)
    if len(split) != len(BLOCKS):
        raise ValueError(f"split needs one IPU per block {BLOCKS}, got {split}")
    stages = []
    for ipu in sorted(set(split)):
        names = [b for b, i in zip(BLOCKS, split) if i == ipu]
        stages.append(Stage(*names).ipu(ipu))
    cls = ShardedExecution if sharded else PipelinedExecution
    return cls(*stages)


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """Percentage of correct predictions, matched to the last labels (as the tutorial does:
    with OutputMode.Final only the last micro-batch's predictions come back)."""
    _, ind = torch.max(predictions, 1)
    labels = labels[-predictions.size()[0]:]
    return torch.sum(torch.eq(ind, labels)).item() / labels.size()[0] * 100.0
