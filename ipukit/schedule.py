"""Alias kept for existing code: ``ipukit.schedule`` is :mod:`ipukit.schedules.ir`."""
import sys

from .schedules import ir as _module

sys.modules[__name__] = _module
