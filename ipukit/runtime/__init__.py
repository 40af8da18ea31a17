"""Floor 4: running a Program.

Threads (:mod:`.executor`, :mod:`.workers`, :mod:`.actions`, :mod:`.update`, ...) and
processes (:mod:`.processes`, on torch.distributed.pipelining) behind one call contract:
record events into a Timeline, scale gradients, produce output rows, step the optimiser,
undo a failed or interrupted call.
"""
