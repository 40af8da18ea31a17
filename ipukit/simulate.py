"""Alias kept for existing code: ``ipukit.simulate`` is :mod:`ipukit.timeline.simulate`."""
import sys

from .timeline import simulate as _module

sys.modules[__name__] = _module
