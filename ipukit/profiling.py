"""PopTorch's ``poptorch.profiling``: trace channels for the user's own code.

PopTorch's :class:`Channel` wrote tracepoints to the ``libpvti`` profiling library when it
was loaded (``PVTI_OPTIONS`` set) and did nothing otherwise. There is no ``libpvti`` off the
IPU, so here a channel always does nothing: ``tracepoint`` returns an empty context manager
and ``instrument`` returns the object unchanged, and programs that use them run as they are.
ipukit's own record of a call is the model's timeline (``model.getTimeline()``).
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
