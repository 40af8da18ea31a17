"""Alias kept for existing code and launch lines: ``ipukit.distributed.example`` is
:mod:`ipukit.examples.distributed` (``python -m ipukit.distributed.example`` still runs it)."""
import sys

from ..examples import distributed as _module

if __name__ == "__main__":
    sys.exit(_module.main())
else:
    sys.modules[__name__] = _module
