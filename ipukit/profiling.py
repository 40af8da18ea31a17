"""PopTorch's ``poptorch.profiling``: trace channels for the user's own code.

PopTorch's :class:`Channel` wrote tracepoints to ``libpvti`` when it was loaded; there is none
off the IPU, so a channel does nothing and programs that use one run as they are. ipukit's
record of a call is the model's timeline (``model.getTimeline()``).
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
