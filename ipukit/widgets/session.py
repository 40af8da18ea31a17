"""Real training for the explorer: ipukit calls, one record per host call.

A :class:`TrainingSession` owns one network, its optimiser and the datasets. Each run
wraps the network with :func:`ipukit.trainingModel` for the chosen configuration and
yields one record per call; weights persist from run to run, so a reader can change
the split or the output mode and keep training the same model.
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..data import DataLoader
from ..model import inferenceModel, trainingModel
from .logic import Config, call_metrics, inference_options, prepare_network, training_options


def first_batch(loader: DataLoader) -> List[torch.Tensor]:
    """One call's worth of samples (the first of the dataset), to compile with."""
    return torch.utils.data.default_collate([loader.dataset[i]
                                             for i in range(loader.combinedBatchSize)])


class TrainingSession:
    """A network, its optimiser and data, trained call by call with ipukit."""

    def __init__(self, model_factory: Callable[[], torch.nn.Module],
                 wrap: Callable[[torch.nn.Module], torch.nn.Module],
                 train_dataset, test_dataset=None, seed: int = 0,
                 test_batch_size: int = 8, inference_iterations: int = 100) -> None:
        self.model_factory, self.wrap, self.seed = model_factory, wrap, seed
        self.train_dataset, self.test_dataset = train_dataset, test_dataset
        self.test_batch_size, self.inference_iterations = test_batch_size, inference_iterations
        self.reset()

    def reset(self) -> None:
        """A freshly initialised network (same seed): forget all training."""
        torch.manual_seed(self.seed)
        self.network: torch.nn.Module = self.model_factory()
        self.optimizer, self._lr, self.last_timeline = None, None, None
        self.steps = self.calls = self.samples = 0      # optimiser steps, host calls, samples

    def _optimizer_for(self, config: Config):
        from ..core.optim import AdamW

        if self.optimizer is None or self._lr != config.learning_rate:
            self.optimizer = AdamW(self.network.parameters(), lr=config.learning_rate)
            self._lr = config.learning_rate
        return self.optimizer

    def run(self, config: Config, calls: int, stop: Optional[threading.Event] = None,
            compile_lock=None) -> Iterator[Dict[str, Any]]:
        """Make up to ``calls`` training calls with ``config``; yield a record after each.

        Epochs follow one another until ``calls`` are done or ``stop`` is set (checked
        between calls). ipukit's errors propagate from the compilation, before any training,
        which holds ``compile_lock`` (if given): two compilations must not overlap.
        """
        opts = training_options(config)
        model = trainingModel(prepare_network(config, self.network, self.wrap), opts,
                              self._optimizer_for(config))
        loader = DataLoader(opts, self.train_dataset, batch_size=config.micro_batch_size,
                            shuffle=True)
        if len(loader) == 0:
            model.destroy()
            raise ValueError(
                f"The training set ({len(self.train_dataset)} samples) is smaller than one "
                f"host call's combined batch ({config.combined_batch} samples): lower the "
                "device iterations, gradient accumulation or micro-batch size.")
        done = 0
        try:
            with compile_lock or nullcontext():
                model.compile(*first_batch(loader))
            while done < calls:
                for data, labels in loader:
                    if done >= calls or (stop is not None and stop.is_set()):
                        return
                    t0 = time.perf_counter()
                    predictions, losses = model(data, labels)
                    seconds = time.perf_counter() - t0
                    self.last_timeline = model.getTimeline()
                    self.calls += 1
                    self.steps += config.device_iterations
                    self.samples += data.shape[0]
                    done += 1
                    yield {"step": self.steps, "call": self.calls, "samples": self.samples,
                           "seconds": seconds,
                           "samples_per_s": data.shape[0] / seconds if seconds > 0 else 0.0,
                           "combined_batch": data.shape[0], "config": config,
                           **call_metrics(predictions, losses, labels, config),
                           "timeline": self.last_timeline}
                if stop is not None and stop.is_set():
                    return
        finally:
            model.destroy()

    def evaluate(self, config: Config, limit: Optional[int] = None,
                 compile_lock=None) -> Optional[float]:
        """Test accuracy (%) with an :func:`ipukit.inferenceModel` of the same stages."""
        if self.test_dataset is None:
            return None
        size = len(self.test_dataset) if limit is None else min(limit, len(self.test_dataset))
        batch = self.test_batch_size
        iterations = max(config.num_stages, min(self.inference_iterations, size // batch))
        if batch * iterations > size:
            return None
        dataset = (self.test_dataset if size >= len(self.test_dataset)
                   else torch.utils.data.Subset(self.test_dataset, range(size)))
        opts = inference_options(config, iterations)
        model = inferenceModel(self.network, opts)
        loader = DataLoader(opts, dataset, batch_size=batch)
        correct = total = 0
        try:
            with compile_lock or nullcontext():
                model.compile(first_batch(loader)[0])
            for data, labels in loader:
                correct += (model(data).argmax(dim=1) == labels).sum().item()
                total += labels.shape[0]
        finally:
            model.destroy()
        return 100.0 * correct / total if total else None
