"""PopTorch's ``Options``: chainable setters, frozen once in use.

An :class:`Options` object is handed to a model or a :class:`~ipukit.DataLoader`;
from then on it is frozen and a setter raises :class:`~ipukit.errors.FrozenOptionsError`
(``options.clone()`` gives a modifiable copy). Setters PopTorch had for the IPU
compiler are accepted so PopTorch programs run unchanged; they have no effect
here and are listed under ``"ignored"`` in :meth:`Options.toDict`.

ipukit's own additions (documented in the README):

* :meth:`Options.pipelineSchedule` — ``"1F1B"`` (default), ``"GPipe"`` and the modern schedules;
* :meth:`Options.deviceMapping` — which torch device each virtual IPU runs on;
* :meth:`Options.cpuThreadsPerIpu` — intra-op threads per virtual-IPU worker;
* :meth:`Options.recordTimeline` and :meth:`Options.profileDir`.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional

from .anchors import Anchor
from .enums import ConnectionType, MeanReductionStrategy, OutputMode, ReductionType
from .errors import OptionsError
from ._options_base import _IgnoredGroup, _jsonable, _OptionGroup, _positive_int
# SCHEDULES has always been importable from here
from .options_setters import SCHEDULES, _IpukitSetters, _PopTorchSetters  # noqa: F401
from .strategies import PipelinedExecution, ShardedExecution


class TensorLocationSettings(_OptionGroup):
    """Where a kind of tensor lives: on the IPU (on chip) or in host memory."""

    _path = "TensorLocationSettings"

    def __init__(self) -> None:
        super().__init__()
        self.on_chip = True
        self.replicated_tensor_sharding = False

    def useOnChipStorage(self, use: bool = True) -> "TensorLocationSettings":
        self._check_not_frozen(f"useOnChipStorage({use!r})")
        self.on_chip = bool(use)
        return self

    def useReplicatedTensorSharding(self, use: bool = True) -> "TensorLocationSettings":
        return self._ignore("useReplicatedTensorSharding", use)

    def minElementsForOffChip(self, n: int) -> "TensorLocationSettings":
        return self._ignore("minElementsForOffChip", n)

    def minElementsForReplicatedTensorSharding(self, n: int) -> "TensorLocationSettings":
        return self._ignore("minElementsForReplicatedTensorSharding", n)

    def useIOTilesToLoad(self, use: bool = True) -> "TensorLocationSettings":
        return self._ignore("useIOTilesToLoad", use)

    def useIOTilesToStore(self, use: bool = True) -> "TensorLocationSettings":
        return self._ignore("useIOTilesToStore", use)

    def toDict(self) -> dict:
        d = {"onChip": self.on_chip}
        d.update(self._ignored)
        return d


class _TensorLocationOptions(_OptionGroup):
    _path = "Options.TensorLocations"

    def __init__(self) -> None:
        super().__init__()
        self.location_activation: Optional[TensorLocationSettings] = None
        self.location_weight: Optional[TensorLocationSettings] = None
        self.location_optimizer: Optional[TensorLocationSettings] = None
        self.location_accumulator: Optional[TensorLocationSettings] = None

    def _set(self, kind: str, location: TensorLocationSettings):
        self._check_not_frozen(f"set{kind.capitalize()}Location(...)")
        if not isinstance(location, TensorLocationSettings):
            raise OptionsError(
                f"Options.TensorLocations.set{kind.capitalize()}Location({location!r}): "
                "expected ipukit.TensorLocationSettings(), e.g. "
                "ipukit.TensorLocationSettings().useOnChipStorage(False).")
        setattr(self, f"location_{kind}", copy.deepcopy(location))
        return self

    def setActivationLocation(self, location: TensorLocationSettings):
        return self._set("activation", location)

    def setWeightLocation(self, location: TensorLocationSettings):
        return self._set("weight", location)

    def setOptimizerLocation(self, location: TensorLocationSettings):
        """``useOnChipStorage(False)`` keeps optimiser state in host memory between steps."""
        return self._set("optimizer", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings):
        return self._set("accumulator", location)

    def numIOTiles(self, n: int):
        return self._ignore("numIOTiles", n)

    def on_chip(self, kind: str) -> bool:
        loc = getattr(self, f"location_{kind}")
        return True if loc is None else loc.on_chip

    def toDict(self) -> dict:
        d = {}
        for kind in ("activation", "weight", "optimizer", "accumulator"):
            loc = getattr(self, f"location_{kind}")
            if loc is not None:
                d[f"location_{kind}"] = loc.toDict()
        if self._ignored:
            d["ignored"] = dict(self._ignored)
        return d


class _TrainingOptions(_OptionGroup):
    _path = "Options.Training"

    def __init__(self) -> None:
        super().__init__()
        self.gradient_accumulation = 1
        self.accumulation_and_replication_reduction_type = ReductionType.Mean

    def gradientAccumulation(self, gradient_accumulation: int) -> "_TrainingOptions":
        """Number of micro-batches whose gradients are combined before each optimiser step."""
        self._check_not_frozen(f"gradientAccumulation({gradient_accumulation!r})")
        self.gradient_accumulation = _positive_int(self._path, "gradientAccumulation",
                                                   gradient_accumulation)
        return self

    def accumulationAndReplicationReductionType(self, reduction_type: ReductionType):
        """``Mean`` (default) averages micro-batch and replica gradients; ``Sum`` adds them."""
        self._check_not_frozen(f"accumulationAndReplicationReductionType({reduction_type!r})")
        if reduction_type not in (ReductionType.Mean, ReductionType.Sum):
            raise OptionsError(
                "Options.Training.accumulationAndReplicationReductionType"
                f"({reduction_type!r}): use ipukit.ReductionType.Mean or ipukit.ReductionType.Sum.")
        self.accumulation_and_replication_reduction_type = ReductionType(reduction_type)
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(self, strategy: MeanReductionStrategy):
        return self._ignore("setMeanAccumulationAndReplicationReductionStrategy", strategy)

    def setAutomaticLossScaling(self, enabled: bool):
        return self._ignore("setAutomaticLossScaling", enabled)

    def setConvolutionDithering(self, enabled: bool):
        return self._ignore("setConvolutionDithering", enabled)

    def toDict(self) -> dict:
        d = {"gradient_accumulation": self.gradient_accumulation,
             "accumulation_and_replication_reduction_type":
                 self.accumulation_and_replication_reduction_type.name}
        if self._ignored:
            d["ignored"] = dict(self._ignored)
        return d


class _PrecisionOptions(_IgnoredGroup):
    _path = "Options.Precision"
    _setters = ("setPartialsType", "enableStochasticRounding", "halfFloatCasting",
                "runningStatisticsAlwaysFloat", "enableFloatingPointExceptions",
                "autocastEnabled", "autocastPolicy")


class _JitOptions(_IgnoredGroup):
    _path = "Options.Jit"
    _setters = ("traceModel",)


class _PopartOptions(_IgnoredGroup):
    _path = "Options._Popart"
    _setters = ("setPatterns", "setEngineOptions")

    def set(self, key: str, value: Any):
        """PopART's raw options; recorded, no effect."""
        self._check_not_frozen(f"set({key!r}, ...)")
        self._ignored[key] = _jsonable(value)
        return self


class _DistributedOptions(_IgnoredGroup):
    """PopTorch's ``Options.Distributed``: which process of a multi-process run this is.

    PopTorch read PopRun's variables; ipukit reads torchrun's (``WORLD_SIZE`` and
    ``RANK``) when the options are created, so a script launched with
    ``ipukit-run``/``torchrun`` runs on :mod:`ipukit.distributed` unchanged.
    ``disable()`` runs this process on its own (threads), whatever the launcher said.
    """

    _path = "Options.Distributed"
    _setters = ("IPUoFConfigFiles",)

    def __init__(self) -> None:
        super().__init__()
        self.numProcesses = 1
        self.processId = 0
        self._env_names = ("WORLD_SIZE", "RANK")
        self._read_env()

    def _read_env(self) -> None:
        size_var, rank_var = self._env_names
        size, rank = os.environ.get(size_var), os.environ.get(rank_var)
        if size is None or rank is None:
            return
        try:
            size_i, rank_i = int(size), int(rank)
        except ValueError:
            raise OptionsError(
                f"Options.Distributed: the environment variables {size_var}={size!r} and "
                f"{rank_var}={rank!r} must be integers (set by torchrun / ipukit-run); unset "
                "them or call Options.Distributed.setEnvVarNames(...) with the right "
                "names.") from None
        self._set(rank_i, size_i, f"{size_var}/{rank_var}")

    def _set(self, process_id: Any, num_processes: Any, what: str) -> None:
        num = _positive_int("Options.Distributed", what, num_processes)
        if isinstance(process_id, bool) or not isinstance(process_id, int) \
                or not 0 <= process_id < num:
            raise OptionsError(
                f"Options.Distributed.{what}: process id {process_id!r} must be an int in "
                f"0..{num - 1} for {num} processes.")
        object.__setattr__(self, "numProcesses", num)
        object.__setattr__(self, "processId", process_id)

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str):
        """Read the process count and id from these environment variables (PopTorch's setter)."""
        self._check_not_frozen(f"setEnvVarNames({var_num_processes!r}, {var_process_id!r})")
        self._env_names = (str(var_num_processes), str(var_process_id))
        self._read_env()
        return self

    def disable(self) -> "_DistributedOptions":
        """Run this process on its own: virtual IPUs as threads, no process group."""
        self._check_not_frozen("disable()")
        self.numProcesses, self.processId = 1, 0
        return self

    def configureProcessId(self, process_id: int, num_processes: int):
        """This is process ``process_id`` of ``num_processes`` (PopTorch's setter)."""
        self._check_not_frozen(f"configureProcessId({process_id!r}, {num_processes!r})")
        self._set(process_id, num_processes,
                  f"configureProcessId({process_id!r}, {num_processes!r})")
        return self


class Options(_PopTorchSetters, _IpukitSetters, _IgnoredGroup):
    """The options of a model and its DataLoader, with PopTorch's setters.

    Every setter returns the options, so calls chain:
    ``Options().deviceIterations(10).replicationFactor(2)``. The setters are
    inherited from :mod:`ipukit.options_setters`; this class holds the state,
    the option groups and the conversions (clone, files, JSON, ``toDict``).
    """

    _path = "Options"
    _ignored_setters = (
        "enableExecutableCaching", "useIpuModel", "autoRoundNumIPUs", "enableSyntheticData",
        "logDir", "syncPattern", "useIpuId", "enableStableNorm",
        "setAvailableMemoryProportion", "enableProfiling", "showCompilationProgressBar",
        "logCycleCount", "useOfflineIpuTarget", "updatableNamedBuffers", "maxRepeatLogs",
        "setExecutionStrategyPhased", "broadcastBuffers", "inputReplicaGrouping",
        "relaxOptimizerAttributesChecks", "disableModuleNamescope",
        "enableProgressBar", "useIpuModelVersion",
    )
    _setters = _ignored_setters  # what _IgnoredGroup answers for

    def __init__(self) -> None:
        super().__init__()
        self.device_iterations = 1
        self.replication_factor = 1
        self.output_mode = OutputMode.Default
        self.output_return_period = 1
        self.random_seed: Optional[int] = None
        self.connection_type = ConnectionType.Always
        self.pipeline_schedule = "1F1B"
        self.device_mapping: Optional[List[str]] = None
        self.cpu_threads_per_ipu: Optional[int] = None
        self.record_timeline = True
        self.profile_dir: Optional[str] = None
        self.model_name: Optional[str] = None
        self.anchored_tensors: Dict[str, Anchor] = {}
        self._execution_strategy: PipelinedExecution = PipelinedExecution()
        self.Training = _TrainingOptions()
        self.TensorLocations = _TensorLocationOptions()
        self.Precision = _PrecisionOptions()
        self.Jit = _JitOptions()
        self.Distributed = _DistributedOptions()
        self._Popart = _PopartOptions()
        defaults = os.environ.get("POPTORCH_DEFAULT_OPTIONS")
        if defaults:  # PopTorch applied these JSON settings to every new Options()
            self.from_json(defaults)

    # -- helpers -----------------------------------------------------------
    @property
    def execution_strategy(self) -> PipelinedExecution:
        return self._execution_strategy

    @property
    def is_sharded(self) -> bool:
        return isinstance(self._execution_strategy, ShardedExecution)

    @property
    def combined_batch_factor(self) -> int:
        """deviceIterations × replicationFactor × gradientAccumulation."""
        return (self.device_iterations * self.replication_factor
                * self.Training.gradient_accumulation)

    def clone(self) -> "Options":
        """A modifiable deep copy (never frozen)."""
        clone = copy.deepcopy(self)
        return clone

    def loadFromFile(self, filepath: str) -> "Options":
        """Apply a PopTorch config file: one setter per line, without ``options.``.

        ``deviceIterations(32)``, ``Training.gradientAccumulation(4)``,
        ``outputMode(poptorch.OutputMode.All)``; ``#`` comments. Later files
        and lines override earlier ones. Arguments must be literals or enum
        values (the file is parsed, not executed).
        """
        from .options_config import apply_lines

        with open(filepath, encoding="utf-8") as f:
            apply_lines(self, f.read().splitlines(), filepath)
        return self

    def from_json(self, string: str) -> "Options":
        """Apply ``{"name.of.setter": value}`` pairs, e.g. ``'{"deviceIterations": 4}'``.

        A list value is passed as several arguments; ``"OutputMode.All"``-style
        strings become enum values.
        """
        from .options_config import apply_json

        apply_json(self, string)
        return self

    def toDict(self) -> dict:
        """All options as a JSON-serialisable dict."""
        d = {
            "device_iterations": self.device_iterations,
            "replication_factor": self.replication_factor,
            "output_mode": self.output_mode.name,
            "output_return_period": self.output_return_period,
            "random_seed": self.random_seed,
            "connection_type": self.connection_type.name,
            "execution_strategy": self._execution_strategy._to_dict(),
            "Training": self.Training.toDict(),
            "TensorLocations": self.TensorLocations.toDict(),
            "ipukit": {
                "pipeline_schedule": self.pipeline_schedule,
                "device_mapping": self.device_mapping,
                "cpu_threads_per_ipu": self.cpu_threads_per_ipu,
                "record_timeline": self.record_timeline,
                "profile_dir": self.profile_dir,
                "model_name": self.model_name,
            },
            "anchored_tensors": {
                a.short_name: [a.long_name, None if a.output_mode is None else a.output_mode.name,
                               a.output_return_period]
                for a in self.anchored_tensors.values()},
        }
        ignored = dict(self._ignored)
        for name, group in (("Precision", self.Precision), ("Jit", self.Jit),
                            ("_Popart", self._Popart), ("Distributed", self.Distributed)):
            if group._ignored:
                ignored[name] = group.toDict()
        if ignored:
            d["ignored"] = ignored
        return d

    def __repr__(self) -> str:
        return f"Options({self.toDict()})"
