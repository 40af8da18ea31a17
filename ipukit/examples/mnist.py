"""The pipelining tutorial's MNIST network: four blocks B1–B4, the loss in the last (the
script, notebooks, benchmarks and tests all train it). ``Network(split=...)`` places the
blocks; :func:`explorer_model` is the dashboard's spec.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..core.blocks import Block
from ..timeline.costs import CostTable
from .spec import ModelSpec, linear_costs

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
    """A strategy placing blocks B1–B4 on IPUs ``split`` (default one IPU each; ``(0, 0, 1, 1)``:
    B1, B2 on IPU 0 and B3, B4 on IPU 1).
    """
    split = tuple(range(len(BLOCKS))) if split is None else tuple(split)
    return explorer_model().strategy(split, sharded=sharded)


# The convnet's reference costs, in seconds: a fixed cost per pass (framework overhead)
# plus a cost per sample, per block, from ipukit.balance.measure_blocks at micro-batches
# of 8, 40 and 128 samples, rounded.
_FIXED = {"forward": dict.fromkeys(BLOCKS, 8.0e-5), "backward": dict.fromkeys(BLOCKS, 1.5e-4)}
_PER_SAMPLE = {
    "forward": {"B1": 7.0e-5, "B2": 3.0e-5, "B3": 4.5e-6, "B4": 1.5e-6},
    "backward": {"B1": 2.4e-5, "B2": 5.4e-5, "B3": 6.0e-6, "B4": 2.0e-6},
}


def reference_costs(micro_batch_size: int = 40) -> CostTable:
    """The convnet's fixed reference cost table (B1 and B2, the convolutions, cost more
    than B3 and B4): numbers that do not depend on the machine."""
    return linear_costs(BLOCKS, _FIXED, _PER_SAMPLE, micro_batch_size,
                        source="the convnet's reference costs")


@functools.lru_cache(maxsize=None)
def explorer_model() -> ModelSpec:
    """The convnet as the notebook dashboard takes it: placed by a stage split of B1–B4,
    the loss added by :class:`TrainingModelWithLoss`, micro-batches of 40 MNIST images
    (the same object on every call)."""
    return ModelSpec("convnet", BLOCKS, Network, TrainingModelWithLoss, micro_batch_size=40,
                     reference_costs=reference_costs)


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """Percentage of correct predictions, matched to the last labels (as the tutorial does:
    with OutputMode.Final only the last micro-batch's predictions come back)."""
    _, ind = torch.max(predictions, 1)
    labels = labels[-predictions.size()[0]:]
    return torch.sum(torch.eq(ind, labels)).item() / labels.size()[0] * 100.0
