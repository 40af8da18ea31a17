"""A model where pipelining can beat the plain loop on a small CPU: an LSTM text classifier.

On a CPU ``nn.LSTM`` runs each time step as a matrix product too small to share between
intra-op threads (and releases the GIL), so a second thread buys the plain loop little while
two pipeline stages, a core each, compute at once. :func:`recurrent_net` builds the
classifier in stages, :func:`sequences` random data for it (notebooks 01 and 03).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import ipukit

CLASSES = 10
VOCABULARY = 1000


class RecurrentStage(nn.Module):
    """One stage of the classifier: (token embedding,) an LSTM over the sequence, (the
    linear classifier on its final state)."""

    def __init__(self, hidden: int, layers: int, first: bool, last: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, hidden) if first else None
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, CLASSES) if last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        y, _ = self.lstm(x)
        return self.head(y[:, -1]) if self.head is not None else y


class StagedNet(nn.Module):
    """``body``'s modules in turn, each a Block on its own virtual IPU (``s0``, ``s1``, ...);
    the cross-entropy loss in the last. Returns the output and the loss."""

    def __init__(self, body: nn.Sequential):
        super().__init__()
        self.body = body

    def forward(self, x, labels):
        last = len(self.body) - 1
        for i, stage in enumerate(self.body):
            with ipukit.Block(f"s{i}", ipu_id=i):
                x = stage(x)
                if i == last:
                    loss = F.cross_entropy(x, labels)
        return x, loss


def recurrent_net(hidden: int, layers: int = 1, stages: int = 2, seed: int = 0) -> StagedNet:
    """The classifier in ``stages`` balanced stages: the embedding and an LSTM on the first,
    an LSTM on each, the classifier on the last."""
    torch.manual_seed(seed)
    return StagedNet(nn.Sequential(*[RecurrentStage(hidden, layers, i == 0, i == stages - 1)
                                     for i in range(stages)]))


def sequences(samples: int, length: int, seed: int = 3) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences and class labels: for speed, not learning."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCABULARY, (samples, length), generator=g),
            torch.randint(0, CLASSES, (samples,), generator=g))
