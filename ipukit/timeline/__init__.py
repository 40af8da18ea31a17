"""Floor 2: what a call did, measured or modeled — pure data.

:mod:`.events` holds the ``Timeline`` type (and ``Event``) that both the runtimes and the
simulator produce; :mod:`.kinds` the kinds of work; :mod:`.simulate` the schedule model;
:mod:`.compare` every schedule modeled side by side.
"""
from .events import Event, Timeline
from .kinds import BACKWARD_END_KINDS, COMPUTE_KINDS, HOST_KINDS, KIND_NAMES

__all__ = ["BACKWARD_END_KINDS", "COMPUTE_KINDS", "Event", "HOST_KINDS", "KIND_NAMES", "Timeline"]
