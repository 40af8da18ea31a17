"""ipukit's verdict on a configuration, compiled in the background.

The explorer asks ipukit itself whether PopTorch would accept the controls'
values, and what memory each stage needs, by compiling the model (no
training): :func:`ipukit.widgets.logic.probe`. Compiling the tutorial's convnet
takes half a second, the ViT several (torch.export traces every layer), so the
:class:`Prober` compiles on a thread of its own, newest request first, and
keeps the results: the modeled view is drawn at once and completed when the
verdict arrives. :meth:`Prober.wait` gives code the synchronous behaviour.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Optional

from . import logic
from .logic import Config

CACHE_SIZE = 64


class Prober:
    """Compiles configurations on a background thread and caches ipukit's verdicts.

    ``compile(config)`` returns a :class:`~ipukit.widgets.logic.ProbeResult`;
    ``on_result(config, result)`` is called (on the prober's thread) for the
    configuration last asked for, once its result is known. ``lock`` is held
    while compiling: tracing uses process-wide state, so two compilations (a
    probe and a training run's) must not overlap.
    """

    def __init__(self, compile: Callable[[Config], logic.ProbeResult],
                 on_result: Callable[[Config, logic.ProbeResult], None], lock) -> None:
        self._compile = compile
        self._on_result = on_result
        self._lock = lock
        self._cache: "OrderedDict[Config, logic.ProbeResult]" = OrderedDict()
        self._wanted: Optional[Config] = None
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._busy = False

    @staticmethod
    def key(config: Config) -> Config:
        return config.with_(learning_rate=0.0)

    def cached(self, config: Config) -> Optional[logic.ProbeResult]:
        with self._cond:
            hit = self._cache.get(self.key(config))
            if hit is not None:
                self._cache.move_to_end(self.key(config))
            return hit

    def request(self, config: Config) -> Optional[logic.ProbeResult]:
        """The verdict on ``config`` if known; else start compiling it and return None."""
        hit = self.cached(config)
        with self._cond:
            self._wanted = None if hit is not None else config
            if hit is None and not self._busy:      # the worker exits only with _busy False
                self._busy = True
                self._thread = threading.Thread(target=self._work, name="ipukit-explorer-probe",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return hit

    def _work(self) -> None:
        while True:
            with self._cond:
                config, self._wanted = self._wanted, None
                if config is None:
                    self._busy = False
                    self._cond.notify_all()
                    return
            with self._lock:
                result = self._compile(config)
            with self._cond:
                self._cache[self.key(config)] = result
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
                latest = self._wanted is None
            if latest:
                self._on_result(config, result)

    @property
    def pending(self) -> bool:
        with self._cond:
            return self._busy

    def wait(self, timeout: Optional[float] = 120.0) -> bool:
        """Block until no configuration is waiting for its verdict; False on timeout."""
        if threading.current_thread() is self._thread:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout)
