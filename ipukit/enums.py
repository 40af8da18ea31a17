"""PopTorch's ``poptorch.enums``: the enumerations of options and operations.

``from poptorch.enums import OutputMode`` works as ``from ipukit.enums import OutputMode``;
the classes are those of :mod:`ipukit.core.enums` (``import ipukit`` exposes them too).
"""
from .core.enums import (AnchorMode, AutoStage, CommGroupType, ConnectionType, DataLoaderMode,
                         HalfFloatCastingBehavior, Liveness, MatMulSerializationMode,
                         MeanReductionStrategy, MultiConvPlanType, OutputMode, OverlapMode,
                         ReductionType, SharingStrategy, SyncPattern, VariableRetrievalMode)

__all__ = ["AnchorMode", "AutoStage", "CommGroupType", "ConnectionType", "DataLoaderMode",
           "HalfFloatCastingBehavior", "Liveness", "MatMulSerializationMode",
           "MeanReductionStrategy", "MultiConvPlanType", "OutputMode", "OverlapMode",
           "ReductionType", "SharingStrategy", "SyncPattern", "VariableRetrievalMode"]
