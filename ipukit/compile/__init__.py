"""Floor 3: from a model and its options to a frozen :class:`~.program.Program`.

Tracing and splitting at block boundaries (:mod:`.partition`, :mod:`.flat`), checks and
device choice (:mod:`.compiler`); ``Program`` is the one seam every runtime reads.
"""
