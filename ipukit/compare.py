"""Alias kept for existing code: ``ipukit.compare`` is :mod:`ipukit.timeline.compare`."""
import sys

from .timeline import compare as _module

sys.modules[__name__] = _module
