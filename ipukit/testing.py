"""PopTorch's ``poptorch.testing``: comparing a model's outputs with reference ones."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["allclose"]


def allclose(ref: Any, other: Any) -> bool:
    """Whether ``other`` has ``ref``'s structure (tensors in nested tuples and lists) and its
    tensors are close to ``ref``'s (:func:`torch.allclose`'s default tolerances)."""
    if isinstance(ref, torch.Tensor):
        return (isinstance(other, torch.Tensor) and other.shape == ref.shape
                and torch.allclose(other, ref))
    if isinstance(ref, (tuple, list)):
        kind = tuple if isinstance(ref, tuple) else list
        return (isinstance(other, kind) and len(other) == len(ref)
                and all(allclose(r, o) for r, o in zip(ref, other)))
    raise TypeError(f"allclose: {type(ref).__name__} is not supported (tensors, tuples and "
                    "lists of them are)")
