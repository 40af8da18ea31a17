"""The explorer's modeled side: the cost table, the modeled call, ipukit's verdict.

:class:`Modeler` turns a :class:`~ipukit.widgets.logic.Config` into a
:class:`~ipukit.widgets.logic.ModeledView` at once, from the model's cost table
calibrated on this machine (:func:`~ipukit.widgets.logic.calibrated_costs`; a Run does
not replace it). ipukit's verdict (:func:`~ipukit.widgets.logic.probe`: would PopTorch
accept it, what memory each stage needs) takes from half a second to several, so a
:class:`Prober` compiles on a thread of its own, newest request first, and caches it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch

from . import logic
from .comparison import ScheduleRow, schedule_rows
from .dashboard import Dashboard
from .data import ExplorerData
from .logic import Config

CACHE_SIZE = 64


class Prober:
    """Compiles configurations on a background thread and caches ipukit's verdicts.

    ``compile(config)`` returns a :class:`~ipukit.widgets.logic.ProbeResult`;
    ``on_result(config, result)`` is called (on the prober's thread) for the configuration
    last asked for. ``lock`` is held while compiling: two compilations must not overlap.
    """

    def __init__(self, compile: Callable[[Config], logic.ProbeResult],
                 on_result: Callable[[Config, logic.ProbeResult], None], lock) -> None:
        self._compile, self._on_result, self._lock = compile, on_result, lock
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


class Modeler:
    """Models the current configuration and keeps ipukit's verdict on it.

    ``on_verdict()`` is called when a verdict changes what the error box shows.
    """

    def __init__(self, models: Dict[str, Any], dashboard: Dashboard,
                 data: ExplorerData, lock, config0: Config,
                 on_verdict: Callable[[], None]) -> None:
        self.models, self.dashboard, self.data = models, dashboard, data
        self._lock, self._on_verdict = lock, on_verdict
        self._networks: Dict[str, torch.nn.Module] = {}
        self.costs: Optional[logic.CostTable] = None        # of the configuration modeled last
        self.config: Optional[Config] = None
        self.view: Optional[logic.ModeledView] = None
        #: every schedule on the same stages, modeled (:func:`~ipukit.widgets.comparison.schedule_rows`)
        self.rows: List[ScheduleRow] = []
        self._verdict_error: Optional[str] = None     # ipukit's verdict on ``config``
        self._rejection: Optional[str] = None         # a control value that makes no config
        self.prober = Prober(self._compile, self._verdict, lock)

    def show(self, config: Config) -> None:
        """Model ``config`` now and draw it; the verdict follows when compiled."""
        with self._lock:
            self.config = config
            samples, parameters = self.data.samples_per_epoch, self.parameters(config.model)
            self.costs = self.costs_for(config)
            self.view = logic.modeled_view(config, self.costs, samples, parameters=parameters)
            self.rows = schedule_rows(config, self.costs, samples, parameters)
            result = self.prober.request(config)
            self._rejection = None
            self._verdict_error = result.error if result is not None else None
            self.dashboard.show_modeled(self.view, result, self.rows)

    def reject(self, message: str) -> None:
        """A control value that makes no configuration: say why, keep the last view."""
        self._rejection = message

    @property
    def config_error(self) -> Optional[str]:
        """What the error box says about the controls (None: nothing known against them)."""
        return self._rejection or self._verdict_error

    def _verdict(self, config: Config, result: logic.ProbeResult) -> None:
        with self._lock:
            if config != self.config:
                return
            self._verdict_error = result.error
            self.dashboard.show_modeled(self.view, result, self.rows)
        self._on_verdict()

    def wait_for_verdict(self, timeout: Optional[float] = 120.0) -> Optional[logic.ProbeResult]:
        """Block until the verdict on the current configuration is known; returns it."""
        self.prober.wait(timeout)
        return self.prober.cached(self.config) if self.config is not None else None

    def _compile(self, config: Config) -> logic.ProbeResult:
        model = self.models[config.model]
        return logic.probe(config, self.network(config.model), model.wrap,
                           self.data.template(getattr(model, "sample_shape", None)))

    def network(self, name: str) -> torch.nn.Module:
        """The throw-away network the verdicts are compiled with (one per model)."""
        if name not in self._networks:
            self._networks[name] = self.models[name].factory()
        return self._networks[name]

    def parameters(self, name: str) -> int:
        return sum(p.numel() for p in self.network(name).parameters())

    # -- read-back (the explorer's attributes) ------------------------------------------
    #: modeled busy fraction of each virtual IPU for the current controls
    modeled_utilisation = property(lambda self: dict(self.view.utilisation))
    modeled_overall = property(lambda self: self.view.overall)
    #: the modeled pipeline fill and drain, a share of all IPU time
    bubble = property(lambda self: self.view.bubble)
    host_calls_per_epoch = property(lambda self: self.view.host_calls_per_epoch)

    def costs_for(self, config: Config) -> logic.CostTable:
        """The cost table of ``config``'s model at its micro-batch size, calibrated the first
        time it is needed (the status line says so meanwhile)."""
        model, size = self.models[config.model], config.micro_batch_size
        if logic.is_calibrated(model, size):
            return logic.calibrated_costs(model, size)
        status = self.dashboard.status
        with self._lock:
            before = status.value
            status.value = (f"Calibrating the {config.model} on this machine (micro-batches of "
                            f"{config.micro_batch_size}), once…")
            try:
                return logic.calibrated_costs(model, size)
            finally:
                if status.value.startswith("Calibrating"):
                    status.value = before
