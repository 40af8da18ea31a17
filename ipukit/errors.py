"""Alias kept for existing code: ``ipukit.errors`` is :mod:`ipukit.core.errors`."""
import sys

from .core import errors as _module

sys.modules[__name__] = _module
