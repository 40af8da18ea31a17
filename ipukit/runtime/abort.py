"""The one abort path of a call: stop every worker, join them, restore the state.

An error on any worker, Ctrl-C (a second one too) and an interrupted step all end a
call here. Each runtime says how to stop its workers (threads: wake every mailbox and
every waiting worker; processes: stop this process's own work — its peers see the
failure through the group) and how to join them; this function runs stop, join and
restore in that order with Ctrl-C deferred, so that no Ctrl-C can leave a worker running
or the weights, buffers and optimiser state half restored. The first error is what the
caller then raises; Ctrl-Cs that arrive during the abort are absorbed by it.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

from .workers import InterruptGuard


def abort_call(stop: Callable[[], None], join: Callable[[Optional[float]], List[str]],
               restore: Optional[Callable[[], None]] = None,
               guard: Optional[InterruptGuard] = None,
               deadline: Optional[float] = None, absorb: bool = True) -> List[str]:
    """Stop, join (waiting at most ``deadline`` seconds if given), then restore.

    Returns the names of workers still alive after the deadline (none without one): a
    worker inside a user's operation cannot be stopped from outside; the caller says so.
    ``absorb=False`` (a call that ended normally) raises a Ctrl-C that arrived meanwhile
    once everything is joined and restored, instead of absorbing it into the first error.
    """
    section = guard.deferred(raise_pending=not absorb) if guard is not None \
        else contextlib.nullcontext()
    with section:
        try:
            stop()
        finally:
            alive = join(deadline)
            if restore is not None:
                restore()
    return alive
