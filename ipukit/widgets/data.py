"""The explorer's data: MNIST (or the caller's datasets), loaded on first use."""
from __future__ import annotations

from typing import List, Optional

import torch

MNIST_SAMPLES = 60000


class ExplorerData:
    """Training and test sets, read lazily (default: the first ``train_limit``/``test_limit``
    samples of real MNIST, :func:`ipukit.datasets.mnist_tensors`; the test set only when
    ``evaluate``); the shape of one sample for compiling without data."""

    def __init__(self, train_dataset=None, test_dataset=None, train_limit: Optional[int] = None,
                 test_limit: Optional[int] = None, sample_shape=None, evaluate: bool = True):
        self._train, self._test = train_dataset, test_dataset
        self.train_limit, self.test_limit = train_limit, test_limit
        self.sample_shape = tuple(sample_shape) if sample_shape is not None else None
        self.evaluate = evaluate

    @property
    def train_dataset(self):
        if self._train is None:
            from ..datasets import mnist_tensors

            self._train = mnist_tensors(train=True, limit=self.train_limit)
        return self._train

    @property
    def test_dataset(self):
        if self._test is None and self.evaluate:
            from ..datasets import mnist_tensors

            self._test = mnist_tensors(train=False, limit=self.test_limit)
        return self._test

    @property
    def samples_per_epoch(self) -> int:
        return len(self._train) if self._train is not None else self.train_limit or MNIST_SAMPLES

    def template(self, model_shape=None) -> List[torch.Tensor]:
        """One sample's input and label as zeros, shaped as given, else as the training set's,
        else ``model_shape`` (the spec's), else MNIST's."""
        if self.sample_shape is not None:
            return [torch.zeros(self.sample_shape), torch.zeros((), dtype=torch.long)]
        if self._train is not None:
            x, y = self._train[0]
            return [torch.zeros_like(torch.as_tensor(x)), torch.zeros_like(torch.as_tensor(y))]
        return [torch.zeros(tuple(model_shape or (1, 28, 28))), torch.zeros((), dtype=torch.long)]
