"""ipukit — PopTorch's pipelining model, running for real on CPUs and GPUs.

``import ipukit as poptorch`` runs ordinary PopTorch programs: Blocks and
Stages split a model across virtual IPUs, pipelined and sharded execution
run micro-batches through per-IPU workers, and every call records a
per-IPU timeline (``model.getTimeline()``).
"""
from . import optim
from .blocks import BeginBlock, Block, BlockFunction, removeBlocks
from .data import AsynchronousDataAccessor, DataLoader
from .enums import (AutoStage, ConnectionType, DataLoaderMode, HalfFloatCastingBehavior,
                    MeanReductionStrategy, OutputMode, ReductionType, SyncPattern)
from .errors import Error
from .model import PoplarExecutor, inferenceModel, trainingModel
from .ops import (identity_loss, ipu_print_tensor, isRunningOnIpu, nop, recomputationCheckpoint,
                  set_available_memory)
from .options import Options, TensorLocationSettings
from .schedule import Action, Schedule
from .simulate import costs_from, model_like, play_on_cores, simulate
from .strategies import (ParallelPhasedExecution, PipelinedExecution, SerialPhasedExecution,
                         ShardedExecution, Stage)
from .timeline import Event, Timeline

__version__ = "0.1.0"

# PopTorch exposed its error class as poptorch.poptorch_core.Error.
poptorch_core = type("poptorch_core", (), {"Error": Error})


def setLogLevel(level) -> None:
    """PopTorch's log level; maps onto the ``ipukit`` logger."""
    import logging

    names = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
             4: logging.ERROR, 5: logging.CRITICAL, 6: logging.CRITICAL + 10}
    if isinstance(level, str):
        value = getattr(logging, level.upper(), logging.INFO)
    else:
        value = names.get(int(level), logging.INFO)
    logging.getLogger("ipukit").setLevel(value)


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """There is no IPU hardware; ipukit's virtual IPUs are always available."""
    return False


__all__ = [
    "AsynchronousDataAccessor", "AutoStage", "BeginBlock", "Block", "BlockFunction",
    "ConnectionType", "DataLoader", "DataLoaderMode", "Error", "Event",
    "HalfFloatCastingBehavior", "MeanReductionStrategy", "Options", "OutputMode",
    "ParallelPhasedExecution", "PipelinedExecution", "PoplarExecutor", "ReductionType",
    "SerialPhasedExecution", "ShardedExecution", "Stage", "SyncPattern", "TensorLocationSettings",
    "Timeline", "Action", "Schedule", "costs_from", "model_like", "play_on_cores", "identity_loss", "inferenceModel",
    "ipuHardwareIsAvailable", "ipu_print_tensor", "isRunningOnIpu", "nop", "optim",
    "recomputationCheckpoint", "removeBlocks", "set_available_memory", "setLogLevel", "simulate",
    "trainingModel",
]
