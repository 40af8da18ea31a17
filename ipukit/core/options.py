"""PopTorch's ``Options``: chainable setters, frozen once handed to a model or a DataLoader
(``options.clone()`` gives a modifiable copy). Setters PopTorch had for the IPU compiler are
accepted with no effect and listed under ``"ignored"`` in :meth:`Options.toDict`; ipukit's
own additions (``pipelineSchedule``, ``deviceMapping``, ``cpuThreadsPerIpu``,
``recordTimeline``, ``profileDir``, ``trackMemory``, ``stallTimeout``) are in docs/options.md.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from .anchors import Anchor
from .enums import ConnectionType, MeanReductionStrategy, OutputMode, ReductionType
from .errors import OptionsError
from ._options_base import _IgnoredGroup, _jsonable, _OptionGroup, _positive_int
from ..schedules.registry import PIPELINED_KINDS, SCHEDULE_TITLES, kind_of
from .strategies import PipelinedExecution, ShardedExecution

#: ``Options.pipelineSchedule``'s accepted names (from the one registry of schedule kinds).
SCHEDULES = SCHEDULE_TITLES
#: seconds without any completed action before a call is stopped (Options.stallTimeout)
DEFAULT_STALL_TIMEOUT = 30.0
_IPUKIT_FIELDS = ("pipeline_schedule", "device_mapping", "cpu_threads_per_ipu", "record_timeline",
                  "profile_dir", "track_memory", "stall_timeout", "model_name")


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
        self._mean_reduction_strategy = MeanReductionStrategy.Post

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
        """When a Mean reduction divides (``Running``, ``Post``, ``PostAndLoss``); recorded only:
        ipukit divides once after accumulating in float32, which gives every strategy's values."""
        name = "meanAccumulationAndReplicationReductionStrategy"
        self._check_not_frozen(f"setMeanAccumulationAndReplicationReductionStrategy({strategy!r})")
        if not isinstance(strategy, MeanReductionStrategy):
            raise OptionsError(
                f"Unexpected type {type(strategy)} for option {name}. Expected "
                f"{MeanReductionStrategy}: use ipukit.MeanReductionStrategy.Post, .Running "
                "or .PostAndLoss.")
        self._ignore("setMeanAccumulationAndReplicationReductionStrategy", strategy)
        self._mean_reduction_strategy = strategy
        return self

    @property
    def meanAccumulationAndReplicationReductionStrategy(self) -> MeanReductionStrategy:  # noqa: N802
        """PopTorch's attribute form (default ``MeanReductionStrategy.Post``)."""
        return self._mean_reduction_strategy

    @meanAccumulationAndReplicationReductionStrategy.setter
    def meanAccumulationAndReplicationReductionStrategy(self, strategy: MeanReductionStrategy):
        self.setMeanAccumulationAndReplicationReductionStrategy(strategy)

    def _repr_items(self):  # the strategy shows once, under PopTorch's attribute name
        return [(k, v) for k, v in super()._repr_items()
                if k != "setMeanAccumulationAndReplicationReductionStrategy"]

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
    """PopTorch's ``Options.Distributed``: which process of a multi-process run this is, read
    from torchrun's ``WORLD_SIZE`` and ``RANK`` (PopTorch read PopRun's) so a script launched
    with ``ipukit-run``/``torchrun`` runs on :mod:`ipukit.distributed` unchanged."""

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


class Options(_IgnoredGroup):
    """The options of a model and its DataLoader, with PopTorch's setters and names.

    Every setter returns the options, so calls chain:

        opts = ipukit.Options().deviceIterations(10).replicationFactor(2)
        opts.Training.gradientAccumulation(8)
        model = ipukit.trainingModel(net, opts, optimizer=optimizer)

    Options are frozen once handed to a model or a DataLoader; ``clone()`` gives a
    modifiable copy. An unknown option is an error that suggests the closest name.

    Option groups (attributes):

    * ``opts.Training``: ``gradientAccumulation(n)``,
      ``accumulationAndReplicationReductionType(ReductionType.Mean | Sum)``,
      ``meanAccumulationAndReplicationReductionStrategy``.
    * ``opts.TensorLocations``: ``setOptimizerLocation``, ``setWeightLocation``,
      ``setActivationLocation``, ``setAccumulatorLocation`` with a
      ``TensorLocationSettings`` (``useOnChipStorage(False)`` keeps optimiser
      state in host memory between steps).
    * ``opts.Distributed``: the process id and count of a run under ``ipukit-run`` /
      torchrun (``configureProcessId``, ``setEnvVarNames``, ``disable()``).
    * ``opts.Precision``, ``opts.Jit`` and ``opts._Popart``: accepted, no effect.

    ipukit's additions: ``pipelineSchedule``, ``deviceMapping``, ``cpuThreadsPerIpu``,
    ``recordTimeline``, ``profileDir``, ``trackMemory``, ``stallTimeout``.

    Accepted for compatibility with **no effect** (recorded under ``"ignored"`` in
    ``toDict()``): ``enableExecutableCaching``, ``useIpuModel``, ``autoRoundNumIPUs``,
    ``enableSyntheticData``, ``syncPattern``, ``useIpuId``, ``enableStableNorm``,
    ``setAvailableMemoryProportion``, ``enableProfiling``, ``showCompilationProgressBar``,
    ``logCycleCount``, ``useOfflineIpuTarget``, ``updatableNamedBuffers``,
    ``maxRepeatLogs``, ``setExecutionStrategyPhased``, ``inputReplicaGrouping``,
    ``relaxOptimizerAttributesChecks``, ``disableModuleNamescope``, ``enableProgressBar``,
    ``useIpuModelVersion``, ``sourceLocationExcludes``, every ``Precision.*`` and
    ``Jit.*`` setter, ``_Popart.set(...)``, ``Training.setAutomaticLossScaling``,
    ``Training.setConvolutionDithering``, ``TensorLocations.numIOTiles``.
    """

    _path = "Options"
    _ignored_setters = (
        "enableExecutableCaching", "useIpuModel", "autoRoundNumIPUs", "enableSyntheticData",
        "syncPattern", "useIpuId", "enableStableNorm",
        "setAvailableMemoryProportion", "enableProfiling", "showCompilationProgressBar",
        "logCycleCount", "useOfflineIpuTarget", "updatableNamedBuffers", "maxRepeatLogs",
        "setExecutionStrategyPhased", "inputReplicaGrouping",
        "relaxOptimizerAttributesChecks", "disableModuleNamescope",
        "enableProgressBar", "useIpuModelVersion",
    )
    _setters = _ignored_setters

    def __init__(self) -> None:
        super().__init__()
        self.device_iterations = 1
        self.replication_factor = 1
        self.log_dir = "."
        self.output_mode = OutputMode.Default
        self.output_return_period = 1
        self.random_seed: Optional[int] = None
        self.connection_type = ConnectionType.Always
        self.pipeline_schedule = "1F1B"
        self.device_mapping: Optional[List[str]] = None
        self.cpu_threads_per_ipu: Optional[int] = None
        self.record_timeline = True
        self.track_memory = False
        self.broadcast_buffers = True
        self.profile_dir: Optional[str] = None
        self.stall_timeout: Optional[float] = DEFAULT_STALL_TIMEOUT
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
        """An independent, modifiable deep copy of every setting (never frozen)."""
        return copy.deepcopy(self)

    def _all_or_nothing(self, apply) -> "Options":
        """Run ``apply()``; if it fails, put every option back as it was."""
        snapshot = self._snapshot()
        try:
            apply()
        except BaseException:
            self._restore(snapshot)
            raise
        return self

    def loadFromFile(self, filepath: str) -> "Options":
        """Apply a PopTorch config file: one setter per line without ``options.``
        (``Training.gradientAccumulation(4)``), ``#`` comments; later lines override earlier.
        Arguments are literals, enums and PopTorch's option objects; the file is parsed, not
        executed, and a file with an error changes nothing."""
        from .options_config import apply_lines

        self._check_not_frozen(f"loadFromFile({filepath!r})")
        with open(filepath, encoding="utf-8") as f:
            lines = f.read().splitlines()
        return self._all_or_nothing(lambda: apply_lines(
            self, lines, filepath, {"TensorLocationSettings": TensorLocationSettings}))

    def from_json(self, string: str) -> "Options":
        """Apply ``{"name.of.setter": value}`` pairs (a list is several arguments,
        ``"OutputMode.All"`` an enum value); a string with an error changes nothing."""
        from .options_config import apply_json

        return self._all_or_nothing(lambda: apply_json(self, string))

    def toDict(self) -> dict:
        """All options as a JSON-serialisable dict."""
        d = {
            "device_iterations": self.device_iterations,
            "replication_factor": self.replication_factor,
            "log_dir": self.log_dir,
            "output_mode": self.output_mode.name,
            "output_return_period": self.output_return_period,
            "random_seed": self.random_seed,
            "connection_type": self.connection_type.name,
            "broadcast_buffers": self.broadcast_buffers,
            "execution_strategy": self._execution_strategy._to_dict(),
            "Training": self.Training.toDict(),
            "TensorLocations": self.TensorLocations.toDict(),
            "ipukit": {k: getattr(self, k) for k in _IPUKIT_FIELDS},
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

    def _repr_items(self):
        """PopTorch's order: its values, then ipukit's, then the groups (its properties)."""
        items = [(k, getattr(self, k)) for k in (
            "replication_factor", "device_iterations", "log_dir", "anchored_tensors",
            "output_mode", "output_return_period", "connection_type", "random_seed",
            "broadcast_buffers")]
        items += [("execution_strategy", self._execution_strategy)]
        items += [(k, getattr(self, k)) for k in _IPUKIT_FIELDS]
        items += list(self._ignored.items())
        return items + sorted((k, v) for k, v in self.__dict__.items()
                              if isinstance(v, _OptionGroup))

    def logDir(self, log_dir: str) -> "Options":
        """Where PopTorch wrote its log files (default ``"."``); recorded, ipukit writes none."""
        self._check_not_frozen(f"logDir({log_dir!r})")
        if isinstance(log_dir, os.PathLike):
            log_dir = os.fspath(log_dir)
        if not isinstance(log_dir, str):
            raise OptionsError(f"Unexpected type {type(log_dir)} for option log_dir. Expected "
                               f"{str}: pass a directory path, e.g. opts.logDir('logs').")
        self.log_dir = log_dir
        return self

    def deviceIterations(self, device_iterations: int) -> "Options":
        """Iterations (optimiser steps when training) per model call."""
        self._check_not_frozen(f"deviceIterations({device_iterations!r})")
        self.device_iterations = _positive_int("Options", "deviceIterations", device_iterations)
        return self

    def replicationFactor(self, replication_factor: int) -> "Options":
        """Number of data-parallel replicas of the model."""
        self._check_not_frozen(f"replicationFactor({replication_factor!r})")
        self.replication_factor = _positive_int("Options", "replicationFactor", replication_factor)
        return self

    def outputMode(self, output_mode: OutputMode, output_return_period: Optional[int] = None):
        """Which micro-batches' outputs a call returns (see :class:`~ipukit.OutputMode`)."""
        self._check_not_frozen(f"outputMode({output_mode!r})")
        try:
            output_mode = OutputMode(output_mode)
        except ValueError:
            raise OptionsError(
                f"Options.outputMode({output_mode!r}): use one of "
                f"{[m.name for m in OutputMode]} (ipukit.OutputMode.All, ...).") from None
        if output_mode == OutputMode.EveryN:
            if output_return_period is None:
                raise OptionsError(
                    "Options.outputMode(OutputMode.EveryN) needs output_return_period=N "
                    "(return the outputs of every N-th micro-batch).")
            self.output_return_period = _positive_int("Options", "outputMode(output_return_period)",
                                                      output_return_period)
        elif output_return_period is not None:  # PopTorch ignores it for other modes
            self.output_return_period = 1
        self.output_mode = output_mode
        return self

    def defaultOutputMode(self) -> bool:
        """True while the output mode is still ``Default``."""
        return self.output_mode == OutputMode.Default

    def anchorMode(self, anchor_mode: OutputMode, anchor_return_period: Optional[int] = None):
        """PopTorch 2.0-2.3's name of :meth:`outputMode`."""
        return self.outputMode(anchor_mode, anchor_return_period)

    def defaultAnchorMode(self) -> bool:
        """The older name of :meth:`defaultOutputMode`."""
        return self.defaultOutputMode()

    def setExecutionStrategy(self, strategy: PipelinedExecution) -> "Options":
        """Use a :class:`~ipukit.PipelinedExecution` or :class:`~ipukit.ShardedExecution`."""
        self._check_not_frozen(f"setExecutionStrategy({strategy!r})")
        if not isinstance(strategy, PipelinedExecution):
            raise OptionsError(
                f"Options.setExecutionStrategy({strategy!r}): expected "
                "ipukit.PipelinedExecution(...) or ipukit.ShardedExecution(...).")
        self._execution_strategy = strategy
        return self

    def randomSeed(self, random_seed: int) -> "Options":
        """Seed torch's random number generator when the model is compiled."""
        self._check_not_frozen(f"randomSeed({random_seed!r})")
        self.random_seed = _positive_int("Options", "randomSeed", random_seed, minimum=0)
        return self

    def connectionType(self, connection_type: ConnectionType) -> "Options":
        self._check_not_frozen(f"connectionType({connection_type!r})")
        self.connection_type = ConnectionType(connection_type)
        return self

    def sourceLocationExcludes(self, excludes: List[str]) -> "Options":
        """Accepted (PopTorch filtered IR source locations; ipukit prints no IR)."""
        return self._ignore("sourceLocationExcludes", list(excludes))

    def appendToLocationExcludes(self, *excludes: str) -> "Options":
        previous = self._ignored.get("sourceLocationExcludes", [])
        return self._ignore("sourceLocationExcludes", list(previous) + list(excludes))

    def pipelineSchedule(self, schedule: str) -> "Options":
        """ipukit: a pipelined model's training schedule: ``"1F1B"`` (default, as PopART),
        ``"GPipe"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"ZBH1"``, ``"ZBV"`` or
        ``"DualPipeV"`` (see :mod:`ipukit.schedules`); torch.distributed.pipelining's names
        (``"interleaved-1f1b"``, ``"ZBVZeroBubble"``...) are accepted too."""
        self._check_not_frozen(f"pipelineSchedule({schedule!r})")
        kind = kind_of(schedule) if isinstance(schedule, str) else None
        if kind is None and isinstance(schedule, str):
            alias = {"zbvzerobubble": "zbv", "interleavedzerobubble": "zb-h1"}
            kind = alias.get(schedule.lower().replace("-", "").replace("_", ""))
        if kind in PIPELINED_KINDS:
            self.pipeline_schedule = PIPELINED_KINDS[kind]
            return self
        raise OptionsError(f"Options.pipelineSchedule({schedule!r}): use one of "
                           f"{list(SCHEDULES)}.")

    def deviceMapping(self, devices: Union[Sequence[Union[str, torch.device]], Dict[int, Any]]):
        """ipukit: the torch device of IPU 0, 1, ... (wrapping around); default the CUDA
        devices round-robin when present, else CPU."""
        self._check_not_frozen(f"deviceMapping({devices!r})")
        if isinstance(devices, dict):
            n = max(devices) + 1 if devices else 0
            devices = [str(devices.get(i, "cpu")) for i in range(n)]
        devices = [str(torch.device(d)) for d in devices]
        if not devices:
            raise OptionsError("Options.deviceMapping([]): give at least one device, e.g. ['cpu'].")
        self.device_mapping = devices
        return self

    def cpuThreadsPerIpu(self, threads: Optional[int]) -> "Options":
        """ipukit: intra-op CPU threads of each virtual-IPU worker; ``None`` (default) divides
        the cores among the workers that run at once."""
        self._check_not_frozen(f"cpuThreadsPerIpu({threads!r})")
        if threads is not None:
            threads = _positive_int("Options", "cpuThreadsPerIpu", threads)
        self.cpu_threads_per_ipu = threads
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> "Options":
        """Whether every replica starts each call from the host's buffers (PopTorch's default)
        or keeps its own across calls (``False``: e.g. per-replica BatchNorm statistics)."""
        self._check_not_frozen(f"broadcastBuffers({broadcast_buffers!r})")
        if not isinstance(broadcast_buffers, bool):
            raise OptionsError(f"broadcastBuffers({broadcast_buffers!r}): expected True or False.")
        self.broadcast_buffers = broadcast_buffers
        return self

    def recordTimeline(self, enabled: bool = True) -> "Options":
        """ipukit: record a per-IPU timeline of every call (on by default)."""
        self._check_not_frozen(f"recordTimeline({enabled!r})")
        self.record_timeline = bool(enabled)
        return self

    def profileDir(self, path: Optional[str]) -> "Options":
        """ipukit: write a Chrome trace and an HTML report of each call to ``path``."""
        self._check_not_frozen(f"profileDir({path!r})")
        self.profile_dir = None if path is None else str(path)
        return self

    def trackMemory(self, enabled: bool = True) -> "Options":
        """ipukit: measure every call's memory per virtual IPU (``Timeline.memory``,
        :func:`ipukit.viz.memory.measured_memory`), as ``with ipukit.track_memory():``; off
        by default, as every operation then goes through a Python hook."""
        self._check_not_frozen(f"trackMemory({enabled!r})")
        if not isinstance(enabled, bool):
            raise OptionsError(f"trackMemory({enabled!r}): expected True or False.")
        self.track_memory = enabled
        return self

    def stallTimeout(self, seconds: Optional[float]) -> "Options":
        """ipukit: stop and undo a call in which no action completed anywhere for ``seconds``
        (default 30; ``None`` or ``0`` disables), raising :class:`~ipukit.core.errors.StallError`
        naming what each stage waits for. Progress is watched, never total time; a call on
        the calling thread alone is not watched."""
        self._check_not_frozen(f"stallTimeout({seconds!r})")
        if seconds is not None and (isinstance(seconds, bool)
                                    or not isinstance(seconds, (int, float))
                                    or not seconds >= 0 or seconds == float("inf")):
            raise OptionsError(f"Options.stallTimeout({seconds!r}): expected a number of "
                               "seconds > 0 (e.g. stallTimeout(30)), or None or 0 to turn "
                               "the watchdog off.")
        self.stall_timeout = float(seconds) if seconds else None
        return self

    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: Optional[OutputMode] = None,
                     output_return_period: Optional[int] = 1) -> "Options":
        """Return an internal tensor after each call: ``model.getAnchoredTensor(short_name)``.
        ``long_name`` is PopART's ``Gradient___<parameter>`` or ``UpdatedVar___<parameter>``;
        the output mode defaults to the model's own (see :mod:`ipukit.anchors`)."""
        self._check_not_frozen(f"anchorTensor({short_name!r}, {long_name!r})")
        if not isinstance(short_name, str) or not isinstance(long_name, str):
            raise OptionsError(f"Options.anchorTensor({short_name!r}, {long_name!r}): "
                               "both names must be strings.")
        period = 1
        if output_mode is not None:
            try:
                output_mode = OutputMode(output_mode)
            except ValueError:
                raise OptionsError(f"Options.anchorTensor(..., output_mode={output_mode!r}): "
                                   f"use one of {[m.name for m in OutputMode]}.") from None
            if output_mode == OutputMode.EveryN:
                period = _positive_int("Options", "anchorTensor(output_return_period)",
                                       output_return_period)
        self.anchored_tensors[short_name] = Anchor(short_name, long_name, output_mode, period)
        return self

    def modelName(self, name: str) -> "Options":
        """The model's name in profiles (default ``training`` / ``inference``)."""
        self._check_not_frozen(f"modelName({name!r})")
        if not isinstance(name, str) or not name:
            raise OptionsError(f"Options.modelName({name!r}): expected a non-empty string.")
        self.model_name = name
        return self


