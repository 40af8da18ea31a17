"""PopTorch's model-wrapper methods that are not calls: state, device, weights, anchors.

Kept apart from :mod:`ipukit.model` (which compiles and runs calls) so each
file holds one concept. Methods that measured or stored IPU-only things raise
:class:`~ipukit.UnsupportedError` saying what ipukit offers instead.
"""
from __future__ import annotations

import datetime
from typing import List, Optional

import torch

from .core import anchors
from .core.errors import ModelStateError, OptionsError, UnsupportedError
from .timeline.events import Timeline

# PopTorch model methods that measured or stored IPU-only things: a clear error
# instead of an AttributeError naming the user's model class.
_TIMELINE = ("ipukit measures wall-clock spans instead: model.getTimeline() holds every "
             "micro-batch's forward/backward per virtual IPU and the host's work.")
_IPU_ONLY_METHODS = {
    "cycleCount": "there are no IPU cycles to count; " + _TIMELINE,
    "getPerfCounters": "there are no IPU host-transfer counters; " + _TIMELINE,
    "getLatency": "there are no IPU host-transfer counters; " + _TIMELINE,
    "getHostIpuLatency": "there are no IPU host-transfer counters; " + _TIMELINE,
    "getComputeLatency": "there are no IPU host-transfer counters; " + _TIMELINE,
    "getIpuHostLatency": "there are no IPU host-transfer counters; " + _TIMELINE,
    "save": ("ipukit has no IPU executable to save; save the weights with "
             "torch.save(model.state_dict(), path)."),
    "compileAndExport": ("ipukit has no IPU executable to export; a model is traced when "
                         "first called. Save the weights with torch.save(model.state_dict(), "
                         "path) instead."),
    "loadExecutable": ("ipukit has no IPU executables; call the model (or "
                       "compile(*inputs)) to prepare it."),
}

DESTROYED = ("This model was destroyed (model.destroy()) and can no longer run. Wrap the "
              "module again: ipukit.trainingModel(module, options, optimizer) or "
              "ipukit.inferenceModel(module, options).")

NOT_COMPILED = ("Model has not been compiled or has been destroyed: call it (or "
                 "model.compile(*inputs)) first.")


class PopTorchMethods:
    """Mixed into :class:`~ipukit.model.PoplarExecutor`."""

    def getTensorNames(self) -> List[str]:
        """The tensors ``Options.anchorTensor`` can name for this model (see :mod:`ipukit.anchors`)."""
        if self._program is None:
            raise ModelStateError(NOT_COMPILED)
        return anchors.tensor_names(self._user_model, self._training)

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value of an anchored tensor from the last call."""
        wanted = self._options.anchored_tensors
        if short_name not in wanted:
            raise OptionsError(
                f"getAnchoredTensor({short_name!r}): no tensor anchored under that name; "
                f"anchored: {sorted(wanted) or 'none'}. Anchor it first with "
                f"options.anchorTensor({short_name!r}, 'Gradient___<parameter>').")
        if short_name not in self._anchored:
            raise ModelStateError(f"getAnchoredTensor({short_name!r}): run the model first; "
                                  "anchored tensors are recorded by each call.")
        return self._anchored[short_name]

    def getTimeline(self) -> Optional[Timeline]:
        """The measured :class:`~ipukit.Timeline` of the last call (None before any call)."""
        source = self.__dict__.get("_timeline_source")
        if source is not None:  # built on first read (stages as processes)
            self.__dict__["_timeline_source"], self._timeline = None, source()
        return self._timeline

    def isCompiled(self) -> bool:
        return self._program is not None

    def isAttachedToDevice(self) -> bool:
        return self._program is not None and self._attached

    def detachFromDevice(self) -> None:
        """Release the virtual IPUs (the next call attaches again)."""
        if self._program is None:
            raise ModelStateError(NOT_COMPILED)
        if not self._attached:
            raise ModelStateError("Device is not attached: call attachToDevice() first, or just "
                                  "call the model, which attaches it.")
        self._attached = False

    def attachToDevice(self) -> None:
        if self._program is None:
            raise ModelStateError(NOT_COMPILED)
        if self._attached:
            raise ModelStateError("Device is already attached.")
        self._attached = True

    def copyWeightsToHost(self) -> None:
        """Weights are shared with the host module: nothing to copy in one process. With stages
        as processes, every process gets every stage's weights (a collective: call it on all)."""
        if self._program is None:
            raise ModelStateError(NOT_COMPILED)
        if self._options.Distributed.numProcesses > 1:
            from .runtime.processes import runtime as distributed

            distributed.synchronize_weights(self)

    def copyWeightsToDevice(self) -> None:
        """Kept for PopTorch programs: weights are shared with the host module, nothing to copy."""
        if self._program is None:
            raise ModelStateError(NOT_COMPILED)

    def copyNamedBuffersToDevice(self) -> None:
        """Kept for PopTorch programs: buffers are shared with the host module, nothing to copy."""
        self.copyWeightsToDevice()

    def compilationTime(self) -> datetime.timedelta:
        """How long tracing and partitioning the model took (its "compilation")."""
        if self._program is None:
            raise ModelStateError(NOT_COMPILED)
        return datetime.timedelta(seconds=self._program.compile_seconds)

    def copyWeightsToHostIfNeeded(self) -> bool:
        return False

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer`` (e.g. with a new learning rate) from the next call on."""
        if not self._training:
            raise ModelStateError("setOptimizer(): an inference model has no optimizer.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptionsError(f"setOptimizer({optimizer!r}): expected a torch.optim.Optimizer.")
        self._optimizer = optimizer

    def destroy(self) -> None:
        """Forget the compiled model and unwrap the module (it can be wrapped again).

        A destroyed wrapper no longer runs: calling it is an error, so two
        training wrappers of one module can never both train.
        """
        self._destroyed = True
        self._program = None
        self.__dict__.pop("_ipukit_distributed", None)
        self._attached = False
        from .model import forget_training_wrapper

        forget_training_wrapper(self)


def ipu_only_method(name: str):
    """A stand-in for a PopTorch method that has no meaning off the IPU, or None."""
    if name not in _IPU_ONLY_METHODS:
        return None

    def unsupported(*args, **kwargs):
        raise UnsupportedError(f"{name}(): {_IPU_ONLY_METHODS[name]}")
    return unsupported
