"""PopTorch's ``poptorch.options``: ``Options``, its option groups and the execution strategies.

PopTorch's option-group classes (``_TrainingOptions``, ``_TensorLocationOptions``, ...) are
the types of an ``Options``' groups, looked up on first use for type annotations.
"""
from .core.errors import ConfigFileError
from .core.options import Options, TensorLocationSettings
from .core.strategies import (ParallelPhasedExecution, Phase, PhasedExecution, PipelinedExecution,
                              SerialPhasedExecution, ShardedExecution, Stage)

__all__ = ["ConfigFileError", "Options", "ParallelPhasedExecution", "Phase", "PhasedExecution",
           "PipelinedExecution", "SerialPhasedExecution", "ShardedExecution", "Stage",
           "TensorLocationSettings"]

#: PopTorch's group class name -> the ``Options`` attribute holding such a group.
_GROUPS = {"_TrainingOptions": "Training", "_TensorLocationOptions": "TensorLocations",
           "_PrecisionOptions": "Precision", "_JitOptions": "Jit",
           "_DistributedOptions": "Distributed"}


def __getattr__(name: str):
    if name in _GROUPS:
        return type(getattr(Options(), _GROUPS[name]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
