"""Alias: ``ipukit.optim`` (PopTorch's ``poptorch.optim``) is :mod:`ipukit.core.optim`."""
import sys

from .core import optim as _module

sys.modules[__name__] = _module
