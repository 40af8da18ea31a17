"""PopTorch's in-model operations that ordinary programs use.

On CPU/GPU most are identities; :func:`identity_loss` marks which output is
the loss that backpropagation starts from.
"""
from __future__ import annotations

import threading
from typing import List, Optional

import torch

from .errors import Error

_marks = threading.local()


class LossMarks:
    """Remembers tensors passed through :func:`identity_loss` while active."""

    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []

    def __enter__(self) -> "LossMarks":
        self._previous = getattr(_marks, "current", None)
        _marks.current = self
        return self

    def __exit__(self, *exc) -> None:
        _marks.current = self._previous


def identity_loss(x: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Mark ``x`` as the loss: backpropagation starts from it.

    ``reduction`` is ``"sum"``, ``"mean"`` or ``"none"`` (PopTorch's values).
    Without an ``identity_loss``, the loss is the model's last output.
    """
    if reduction == "sum":
        out = x.sum()
    elif reduction == "mean":
        out = x.mean()
    elif reduction == "none":
        out = x * 1 if x.requires_grad else x
    else:
        raise Error(f"identity_loss(..., reduction={reduction!r}): use 'sum', 'mean' or 'none'.")
    current: Optional[LossMarks] = getattr(_marks, "current", None)
    if current is not None:
        current.tensors.append(out)
    return out


_running = threading.local()


def isRunningOnIpu() -> bool:
    """True while the model runs inside an ipukit model (on a virtual IPU)."""
    return getattr(_running, "value", False)


class running_on_ipu:
    """Context manager that makes :func:`isRunningOnIpu` return True."""

    def __enter__(self):
        self._previous = getattr(_running, "value", False)
        _running.value = True

    def __exit__(self, *exc):
        _running.value = self._previous


def ipu_print_tensor(tensor: torch.Tensor, title: str = "", *args, **kwargs) -> torch.Tensor:
    """Identity (PopTorch printed the tensor from the IPU)."""
    return tensor


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """Identity."""
    return tensor


def recomputationCheckpoint(*tensors):
    """Identity (recomputation is an IPU memory technique)."""
    return tensors[0] if len(tensors) == 1 else tensors


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float) -> torch.Tensor:
    """Identity (an IPU tile-memory hint)."""
    return tensor
