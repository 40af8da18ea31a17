"""What ``ipukit.DataLoader`` loads in a process of a launched run.

Every process of one replica sees the same combined batches; data-parallel instance *i* of
*R* takes the *i*-th contiguous share of a permutation drawn from ``Options.randomSeed``
(0 when unset), a new one each pass, every share the same whole number of batches. A
process's combined batch is ``batch_size × deviceIterations × gradientAccumulation``.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from .runtime import DistributedError


def instance_of(options) -> Tuple[int, int]:
    """(this process's data-parallel instance, instances) under ``options``."""
    d = options.Distributed
    replicas = options.replication_factor
    if d.numProcesses % replicas:
        raise DistributedError(
            f"ipukit.DataLoader: {d.numProcesses} processes cannot hold replicationFactor "
            f"{replicas} replicas of equal size; launch a multiple of {replicas} processes "
            "(virtual IPUs × replicationFactor).")
    per_replica = d.numProcesses // replicas
    return d.processId // per_replica, replicas


class ShareSampler(torch.utils.data.Sampler):
    """Indices of one instance's contiguous share, the same on every process of its pipeline."""

    def __init__(self, length: int, instance: int, instances: int, combined: int,
                 shuffle: bool, seed: int) -> None:
        self.length = length
        self.instance = instance
        self.share = length // instances
        self.num_samples = (self.share // combined) * combined
        if self.num_samples == 0:
            raise DistributedError(
                f"ipukit.DataLoader: {length} samples split over {instances} data-parallel "
                f"instances leave {self.share} per instance, fewer than one combined batch "
                f"({combined}); use a larger dataset or a smaller batch_size.")
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        self.epoch += 1  # the next pass draws a new permutation, the same everywhere
        start = self.instance * self.share
        return iter(order[start:start + self.num_samples])

    def __len__(self) -> int:
        return self.num_samples


def process_batches(options, dataset, batch_size: int, shuffle: Optional[bool],
                    partition: bool) -> Tuple[int, Optional[ShareSampler]]:
    """(combined batch of this process, the sampler to use or None) for a launched run."""
    instance, instances = instance_of(options)
    combined = batch_size * options.device_iterations * options.Training.gradient_accumulation
    if not partition:
        return combined, None
    try:
        length = len(dataset)
    except TypeError:  # an iterable dataset: the user shards it
        return combined, None
    seed = options.random_seed if options.random_seed is not None else 0
    return combined, ShareSampler(length, instance, instances, combined, bool(shuffle), seed)
