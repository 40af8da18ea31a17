"""The setters of :class:`~ipukit.Options`, as two mixins.

``Options`` keeps its state, its option groups and its conversions; the
setters live here, split by origin, so that each class stays one readable page:

* :class:`_PopTorchSetters` — PopTorch's own setters (device iterations,
  replication, output mode, execution strategy, seed...);
* :class:`_IpukitSetters` — ipukit's additions (schedule, device mapping, threads,
  timeline, profiles, model name) and PopTorch's anchored tensors.

Every setter checks the options are not frozen, validates, stores and returns
``self`` so calls chain.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

import torch

from .anchors import Anchor
from .enums import ConnectionType, OutputMode
from .errors import OptionsError
from ._options_base import _OptionGroup, _positive_int
from ..schedules.ir import PIPELINED_KINDS, kind_of
from .strategies import PipelinedExecution

if TYPE_CHECKING:
    from .options import Options

SCHEDULES = tuple(PIPELINED_KINDS.values())


class _PopTorchSetters(_OptionGroup):
    """PopTorch's setters of ``Options`` (the attributes are created by ``Options.__init__``)."""

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
        elif output_return_period is not None:
            # PopTorch ignores the period for other modes; so do we.
            self.output_return_period = 1
        self.output_mode = output_mode
        return self

    def defaultOutputMode(self) -> bool:
        """True while the output mode is still ``Default``."""
        return self.output_mode == OutputMode.Default

    # PopTorch 2.0-2.3 called the output mode the "anchor" mode.
    def anchorMode(self, anchor_mode: OutputMode, anchor_return_period: Optional[int] = None):
        """The older name of :meth:`outputMode` (``AnchorMode`` is ``OutputMode``)."""
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
        """Accepted (PopTorch filtered IR source locations; ipukit prints no IR)."""
        previous = self._ignored.get("sourceLocationExcludes", [])
        return self._ignore("sourceLocationExcludes", list(previous) + list(excludes))


class _IpukitSetters(_OptionGroup):
    """ipukit's additions to ``Options``, plus PopTorch's anchored tensors and model name."""

    def pipelineSchedule(self, schedule: str) -> "Options":
        """ipukit: the training schedule of a pipelined model (see :mod:`ipukit.schedules`).

        ``"1F1B"`` (the default) runs, in the steady state, one forward then one
        backward on each IPU, as PopART did; ``"GPipe"`` runs all forwards of an
        accumulation window, then all backwards. ``"Interleaved1F1B"`` and
        ``"LoopedBFS"`` run several stages per IPU placed in a loop
        (stage s on IPU s mod P); ``"ZBH1"`` splits each backward into an
        input-gradient and a weight-gradient action and fills the bubble with the
        latter; ``"ZBV"`` and ``"DualPipeV"`` do so with two stages per IPU placed
        in a V (IPU i holds stages i and 2P−1−i). torch.distributed.pipelining's
        names (``"interleaved-1f1b"``, ``"ZBVZeroBubble"``…) are accepted too.
        """
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
        """ipukit: the torch device of each virtual IPU.

        A list gives the device of IPU 0, 1, ...; IPUs beyond its end wrap
        around. The default is the CUDA devices round-robin when present, else CPU.
        """
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
        """ipukit: intra-op CPU threads of each virtual-IPU worker.

        ``None`` (default) divides the machine's cores among the workers that
        run at once, so pipelined stages do not oversubscribe the CPU.
        """
        self._check_not_frozen(f"cpuThreadsPerIpu({threads!r})")
        if threads is not None:
            threads = _positive_int("Options", "cpuThreadsPerIpu", threads)
        self.cpu_threads_per_ipu = threads
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

    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: Optional[OutputMode] = None,
                     output_return_period: Optional[int] = 1) -> "Options":
        """Return an internal tensor after each call: ``model.getAnchoredTensor(short_name)``.

        ``long_name`` is PopART's name: ``Gradient___<parameter>`` (each
        micro-batch's gradient) or ``UpdatedVar___<parameter>`` (the weight after
        each step), for the wrapped module's ``named_parameters()``. The output
        mode defaults to the model's own (see :mod:`ipukit.anchors`).
        """
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
