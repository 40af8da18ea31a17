"""Alias kept for existing code: ``ipukit.memory`` is :mod:`ipukit.viz.memory`."""
import sys

from .viz import memory as _module

sys.modules[__name__] = _module
