"""ipukit — PopTorch's pipelining model, running for real on CPUs and GPUs.

``import ipukit as poptorch`` runs ordinary PopTorch programs: Blocks and
Stages split a model across virtual IPUs, pipelined and sharded execution
run micro-batches through per-IPU workers, and every call records a
per-IPU timeline (``model.getTimeline()``).
"""
from . import enums, ops, optim, options, profiling
from .core.blocks import BeginBlock, Block, BlockFunction, module_repr, removeBlocks
from .core.enums import (AnchorMode, AutoStage, CommGroupType, ConnectionType, DataLoaderMode,
                         HalfFloatCastingBehavior, Liveness, MatMulSerializationMode,
                         MeanReductionStrategy, MultiConvPlanType, OutputMode, OverlapMode,
                         ReductionType, SharingStrategy, SyncPattern, VariableRetrievalMode)
from .core.errors import Error, OptionsError, UnsupportedError
from .core.ops import (CPU, MultiConv, NameScope, cond, ctc_beam_search_decoder, custom_op,
                       dynamic_slice, dynamic_update, for_loop, identity_loss, ipu_print_tensor,
                       isRunningOnIpu, nop, recomputationCheckpoint, serializedMatMul,
                       set_available_memory, set_overlap_for_input, set_overlap_for_output)
from .core.options import Options, TensorLocationSettings
from .core.strategies import (ParallelPhasedExecution, Phase, PhasedExecution,
                              PipelinedExecution, SerialPhasedExecution, ShardedExecution, Stage)
from .calibrate import calibrate
from .plan import plan
from .data import AsynchronousDataAccessor, DataLoader
from .ipuconfig import (IncompatibleIPUConfigError, IPUConfig, get_layer_ipu,
                        recomputation_checkpoint, split_encoder_decoder_ipu_config)
from .model import (ICustomArgParser, PoplarExecutor, inferenceModel, registerCustomArgParser,
                    registerPostCompileHook, registerPreCompileHook, trainingModel)
from .runtime.memory_track import track_memory
from .schedules import Action, Schedule
from .timeline import Event, Timeline
from .timeline.compare import compare_schedules
from .timeline.simulate import costs_from, simulate

__version__ = "0.1.0"

# PopTorch's poptorch_core.Error and its recoverable/unrecoverable split: every ipukit
# error leaves the model usable, so each name catches all of them.
poptorch_core = type("poptorch_core", (), {"Error": Error})
RecoverableError = Error
UnrecoverableError = Error


_LOG_LEVELS = {"TRACE": (0, 10), "DEBUG": (1, 10), "INFO": (2, 20), "WARN": (3, 30),
               "ERR": (4, 40), "OFF": (6, 50)}


def setLogLevel(level) -> None:
    """PopTorch's log level (``"TRACE"`` ... ``"OFF"``, or 0-4, 6); sets the ``ipukit`` logger.

    The value is checked before anything changes: a rejected level leaves the logger as it was.
    """
    import logging

    if isinstance(level, int) and not isinstance(level, bool):
        names = [name for name, (number, _) in _LOG_LEVELS.items() if number == level]
        if not names:
            raise OptionsError(f"Invalid log level integer: setLogLevel({level}). Use 0 (TRACE) "
                               "to 4 (ERR), 6 (OFF), or a level name.")
        level = names[0]
    if not isinstance(level, str) or level not in _LOG_LEVELS:
        valid = sorted(_LOG_LEVELS)
        raise OptionsError(f"Unknown log level: {level}. Valid values are "
                           f"{', '.join(valid[:-1])} and {valid[-1]}.")
    logging.getLogger("ipukit").setLevel(_LOG_LEVELS[level][1])


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """There is no IPU hardware; ipukit's virtual IPUs are always available."""
    return False


def ipuHardwareVersion() -> int:
    """PopTorch's IPU generation query; like PopTorch without hardware, it raises."""
    raise UnsupportedError(
        "ipuHardwareVersion(): there is no IPU hardware; ipukit runs on virtual IPUs. "
        "Check ipuHardwareIsAvailable() (always False) before asking for the version.")


def load(filename: str, edit_opts_fn=None):
    """PopTorch loaded compiled IPU executables; there are none off the IPU."""
    raise UnsupportedError(
        f"load({filename!r}): ipukit compiles nothing to disk, so there is no "
        "executable to load. Build the model with trainingModel/inferenceModel and load "
        "its weights with torch.load + model.load_state_dict instead.")


__all__ = [
    "AsynchronousDataAccessor", "AutoStage", "BeginBlock", "Block", "BlockFunction",
    "ConnectionType", "DataLoader", "DataLoaderMode", "Error", "Event",
    "HalfFloatCastingBehavior", "MeanReductionStrategy", "Options", "OutputMode",
    "ParallelPhasedExecution", "PipelinedExecution", "PoplarExecutor", "ReductionType",
    "SerialPhasedExecution", "ShardedExecution", "Stage", "SyncPattern", "TensorLocationSettings",
    "Timeline", "Action", "Schedule", "costs_from", "identity_loss", "inferenceModel",
    "ipuHardwareIsAvailable", "ipu_print_tensor", "isRunningOnIpu", "nop", "optim",
    "recomputationCheckpoint", "removeBlocks", "set_available_memory", "setLogLevel", "simulate",
    "compare_schedules",
    "trainingModel", "AnchorMode", "CommGroupType", "Liveness", "MatMulSerializationMode",
    "MultiConvPlanType", "OverlapMode", "SharingStrategy", "VariableRetrievalMode", "CPU",
    "MultiConv", "NameScope", "cond", "ctc_beam_search_decoder", "custom_op", "dynamic_slice",
    "dynamic_update", "for_loop", "serializedMatMul", "set_overlap_for_input",
    "set_overlap_for_output", "Phase", "PhasedExecution", "RecoverableError", "UnrecoverableError",
    "ipuHardwareVersion", "load", "registerPreCompileHook", "registerPostCompileHook",
    "IPUConfig", "IncompatibleIPUConfigError", "get_layer_ipu", "recomputation_checkpoint",
    "split_encoder_decoder_ipu_config", "calibrate", "plan", "module_repr", "ICustomArgParser",
    "registerCustomArgParser", "track_memory",
]
