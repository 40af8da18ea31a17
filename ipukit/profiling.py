"""PopTorch's ``poptorch.profiling``: trace channels for the user's own code. There is no
``libpvti`` off the IPU, so a channel records nothing; a call's record is its timeline.
"""
from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["Channel"]


class Channel:
    """A named profiling channel (PopTorch's), which records nothing off the IPU.

    >>> channel = Channel("MyApp")
    >>> with channel.tracepoint("TimeThis"):
    ...     pass
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def instrument(self, obj: Any, *methods: str) -> Any:
        """Wrap ``obj``'s ``methods`` in tracepoints: here, ``obj`` is returned unchanged."""
        return obj

    def tracepoint(self, name: str) -> contextlib.AbstractContextManager:
        """A context manager marking a span named ``name``; here it records nothing."""
        return contextlib.nullcontext()
