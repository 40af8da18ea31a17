"""Alias kept for existing code: ``ipukit.schedule`` is :mod:`ipukit.schedules` (the IR,
``build`` and ``walk`` are all there)."""
import sys

from . import schedules as _module

sys.modules[__name__] = _module
