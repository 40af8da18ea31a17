"""Worker threads for virtual IPUs: mailboxes, a pool with tested join semantics, Ctrl-C.

:class:`Exchange`: one mailbox per message, so a message wakes only the worker waiting for
it and an abort wakes everyone. :class:`Pool`: one thread per worker; :meth:`Pool.join`
returns only when every thread has ended, even if Ctrl-C is pressed again, so a call never
returns with a worker still running. :class:`InterruptGuard`: Ctrl-C stops a call at once,
except inside :meth:`InterruptGuard.deferred` sections (an optimiser step, an undo).
"""
from __future__ import annotations

import _thread
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Sequence


class Aborted(Exception):
    """Raised inside workers when another worker failed or the call was interrupted."""


class Exchange:
    """Mailboxes between workers: activations forward, gradients backward.

    One slot per message key holding a raw lock, acquired while the slot is
    empty: ``take`` blocks on it and ``put`` releases it, so a message wakes
    only the worker waiting for it, with no Event or Condition per message.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: Dict[tuple, list] = {}
        self._aborted = False

    def _slot(self, key: tuple) -> list:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                gate = _thread.allocate_lock()
                if not self._aborted:
                    gate.acquire()  # closed until the message arrives
                slot = self._slots[key] = [None, gate]
            return slot

    @staticmethod
    def _open(gate) -> None:
        try:
            gate.release()
        except RuntimeError:  # already open (an abort raced a put)
            pass

    def put(self, key: tuple, value: Any) -> None:
        slot = self._slot(key)
        slot[0] = value
        self._open(slot[1])

    def take(self, key: tuple) -> Any:
        slot = self._slot(key)
        slot[1].acquire()
        if self._aborted:
            self._open(slot[1])  # let any other waiter through too
            raise Aborted()
        with self._lock:
            del self._slots[key]
        return slot[0]

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            for slot in self._slots.values():
                self._open(slot[1])

    @property
    def aborted(self) -> bool:
        return self._aborted


class Pool:
    """One thread per worker; the first error stops them all.

    ``target(index)`` runs on worker ``index``. A worker that raises records the
    error (the first one wins; :class:`Aborted` never does) and calls
    ``on_error`` — typically :meth:`Exchange.abort`, which wakes every other
    worker so it can stop too.
    """

    def __init__(self, names: Sequence[str], target: Callable[[int], None],
                 on_error: Optional[Callable[[], None]] = None) -> None:
        self.error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._on_error = on_error
        self._target = target
        self.threads = [threading.Thread(target=self._run, args=(i,), name=name, daemon=True)
                        for i, name in enumerate(names)]

    def _run(self, index: int) -> None:
        try:
            self._target(index)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` (unless an error is already recorded) and stop the workers."""
        with self._lock:
            if self.error is None and not isinstance(exc, Aborted):
                self.error = exc
        if self._on_error is not None:
            self._on_error()

    def start(self) -> "Pool":
        for t in self.threads:
            t.start()
        return self

    def alive(self) -> List[str]:
        return [t.name for t in self.threads if t.is_alive()]

    def join(self, deadline: Optional[float] = None) -> List[str]:
        """Wait for every worker to end, whatever happens meanwhile; the names still alive.

        Waits in short slices so the main thread stays responsive; a Ctrl-C
        arriving while it waits stops the workers (via ``fail``) and the wait
        goes on; it is raised once every worker has ended. With ``deadline``
        (seconds), it waits no longer and returns the workers still running.
        """
        interrupted: Optional[BaseException] = None
        end = None if deadline is None else time.monotonic() + deadline
        for t in self.threads:
            while t.is_alive() and (end is None or time.monotonic() < end):
                try:
                    t.join(timeout=0.05)
                except KeyboardInterrupt as exc:
                    interrupted = interrupted or exc
                    self.fail(exc)
        if interrupted is not None:
            raise interrupted
        return self.alive()


class InterruptGuard:
    """Ctrl-C handling for one call on the main thread (a no-op on other threads).

    Outside :meth:`deferred` sections Ctrl-C raises ``KeyboardInterrupt`` at
    once, as usual; inside them it is remembered and raised when the
    outermost section ends, so no optimiser step or restore is left half done.
    """

    def __init__(self) -> None:
        self._depth = 0
        self.pending = False
        self._previous = None
        self._installed = False

    def _handler(self, signum, frame) -> None:
        if self._depth:
            self.pending = True
        else:
            raise KeyboardInterrupt

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            try:
                self._previous = signal.signal(signal.SIGINT, self._handler)
                self._installed = True
            except ValueError:  # signals unavailable (embedded interpreter)
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    @contextmanager
    def deferred(self, raise_pending: bool = True):
        """Ctrl-C waits until this section ends (then raises, if ``raise_pending``)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if raise_pending and self._depth == 0 and self.pending:
            self.pending = False
            raise KeyboardInterrupt
