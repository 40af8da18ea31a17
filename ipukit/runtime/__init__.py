"""Floor 4: running a Program, on threads (:mod:`.executor`) or processes (:mod:`.processes`),
behind one call contract (:mod:`.contract`).
"""
