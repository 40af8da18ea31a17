"""Alias kept for existing code: ``ipukit.update`` is :mod:`ipukit.runtime.update`."""
import sys

from .runtime import update as _module

sys.modules[__name__] = _module
