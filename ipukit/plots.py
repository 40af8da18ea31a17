"""Alias kept for existing code: ``ipukit.plots`` is :mod:`ipukit.viz.plots`."""
import sys

from .viz import plots as _module

sys.modules[__name__] = _module
