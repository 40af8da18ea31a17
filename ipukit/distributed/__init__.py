"""Scale out: the same annotated model and Options as processes, under torchrun.

A process is one virtual IPU of one replica, launched with ``ipukit-run --nproc N script.py``;
Options built under the launcher read torchrun's ``RANK``/``WORLD_SIZE``, and the model runs
its stages on ``torch.distributed.pipelining``. An *instance* is a data-parallel replica.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..core.errors import Error
from ..runtime.processes.runtime import (NOT_DISTRIBUTED, DistributedError, is_active,
                                         maybe_run, synchronize_weights)

__all__ = ["DistributedError", "Options", "getInstanceIndex", "getNumInstances",
           "getNumTotalReplicas", "getNumLocalReplicas", "getProcessIndex", "getNumProcesses",
           "isPopdistEnvSet", "trainingModel", "inferenceModel", "synchronize_weights",
           "maybe_run", "NOT_DISTRIBUTED", "is_active", "DistributedModel"]

_IPUS_PER_REPLICA: Optional[int] = None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"ipukit.distributed: environment variable {name}={value!r} "
                               "must be an integer (torchrun sets it).") from None


def isPopdistEnvSet() -> bool:  # noqa: N802 - popdist's name
    """Whether this process was started by a launcher (torchrun's RANK and WORLD_SIZE set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def getProcessIndex() -> int:  # noqa: N802
    """This process's rank (0 when not launched)."""
    return _env_int("RANK", 0)


def getNumProcesses() -> int:  # noqa: N802
    """Processes in the run (1 when not launched)."""
    return _env_int("WORLD_SIZE", 1)


def _ipus_per_replica(ipus_per_replica: Optional[int]) -> int:
    n = ipus_per_replica if ipus_per_replica is not None else _IPUS_PER_REPLICA
    if n is None:
        n = _env_int("IPUKIT_IPUS_PER_REPLICA", 0) or None
    if n is None:
        raise DistributedError(
            "ipukit.distributed: how many virtual IPUs (processes) one replica has is not known "
            "yet: pass ipus_per_replica=N, or build the options with "
            "ipukit.distributed.Options(ipus_per_replica=N).")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DistributedError(f"ipukit.distributed: ipus_per_replica={n!r}: expected an int >= 1.")
    world = getNumProcesses()
    if world % n:
        raise DistributedError(
            f"ipukit.distributed: {world} processes (WORLD_SIZE) cannot be split into replicas of "
            f"{n} virtual IPUs each; launch a multiple of {n} processes.")
    return n


def getNumInstances(ipus_per_replica: Optional[int] = None) -> int:  # noqa: N802
    """Data-parallel instances (PopTorch's processes): processes ÷ virtual IPUs per replica."""
    return getNumProcesses() // _ipus_per_replica(ipus_per_replica)


def getInstanceIndex(ipus_per_replica: Optional[int] = None) -> int:  # noqa: N802
    """Which data-parallel instance (replica) this process belongs to."""
    return getProcessIndex() // _ipus_per_replica(ipus_per_replica)


def getNumTotalReplicas(ipus_per_replica: Optional[int] = None) -> int:  # noqa: N802
    """Replicas over the whole run (one per instance: a process is one IPU of one replica)."""
    return getNumInstances(ipus_per_replica)


def getNumLocalReplicas() -> int:  # noqa: N802
    """Replicas per instance: always 1 here (the replica's IPUs are processes, not threads)."""
    return 1


def Options(ipus_per_replica: int = 1, **kwargs: Any):  # noqa: N802 - popdist.poptorch.Options
    """``ipukit.Options`` for this process of a launched run (popdist.poptorch.Options' role):
    ``replicationFactor`` is processes ÷ ``ipus_per_replica``, and the process id is set.
    Outside a launch it is a plain ``Options()``.
    """
    from ..core.options import Options as _Options

    global _IPUS_PER_REPLICA
    n = _ipus_per_replica(ipus_per_replica)
    _IPUS_PER_REPLICA = n
    opts = _Options(**kwargs)
    world = getNumProcesses()
    if world > 1:
        opts.replicationFactor(world // n)
        opts.Distributed.configureProcessId(getProcessIndex(), world)
    return opts


class DistributedModel:
    """A training or inference model that runs on processes when launched, threads otherwise;
    attribute access falls through to the wrapped ipukit model."""

    def __init__(self, executor) -> None:
        object.__setattr__(self, "_executor", executor)

    def __call__(self, *args, **kwargs):
        return self._executor(*args, **kwargs)  # runs as processes when launched

    def synchronize_weights(self) -> None:
        """Every process gets every stage's latest weights (call on all processes)."""
        synchronize_weights(self._executor)

    def __getattr__(self, name: str):
        return getattr(self._executor, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._executor, name, value)

    def __repr__(self) -> str:
        return f"ipukit.distributed.{self._executor!r}"


def trainingModel(model, options=None, optimizer=None) -> DistributedModel:  # noqa: N802
    """``ipukit.trainingModel`` that runs as processes under ipukit-run/torchrun."""
    from ..model import trainingModel as _training

    return DistributedModel(_training(model, options, optimizer=optimizer))


def inferenceModel(model, options=None) -> DistributedModel:  # noqa: N802
    """``ipukit.inferenceModel`` that runs as processes under ipukit-run/torchrun."""
    from ..model import inferenceModel as _inference

    return DistributedModel(_inference(model, options))
