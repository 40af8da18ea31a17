"""Alias kept for existing code: ``ipukit.workers`` is :mod:`ipukit.runtime.workers`."""
import sys

from .runtime import workers as _module

sys.modules[__name__] = _module
