"""The explorer's modeled side: the cost table, the modeled call, ipukit's verdict.

:class:`Modeler` turns a :class:`~ipukit.widgets.logic.Config` into a
:class:`~ipukit.widgets.logic.ModeledView` at once, from the model's cost table
calibrated on this machine (:func:`~ipukit.widgets.logic.calibrated_costs`: once per
model and micro-batch size; a Run does not replace it), and asks a
:class:`~ipukit.widgets.prober.Prober` for ipukit's verdict (compiling in the
background); both are drawn on the :class:`~ipukit.widgets.dashboard.Dashboard`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from . import logic
from .comparison import ScheduleRow, schedule_rows
from .dashboard import Dashboard
from .data import ExplorerData
from .logic import Config
from .prober import Prober


class Modeler:
    """Models the current configuration and keeps ipukit's verdict on it.

    ``on_verdict()`` is called when a verdict changes what the error box shows.
    """

    def __init__(self, models: Dict[str, Any], dashboard: Dashboard,
                 data: ExplorerData, lock, config0: Config,
                 on_verdict: Callable[[], None]) -> None:
        self.models = models
        self.dashboard = dashboard
        self.data = data
        self._lock = lock
        self._on_verdict = on_verdict
        self._networks: Dict[str, torch.nn.Module] = {}
        #: the cost table of the configuration modeled last
        self.costs: Optional[logic.CostTable] = None
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
    @property
    def modeled_utilisation(self) -> Dict[int, float]:
        """Modeled busy fraction of each virtual IPU for the current controls."""
        return dict(self.view.utilisation)

    @property
    def modeled_overall(self) -> float:
        return self.view.overall

    @property
    def bubble(self) -> float:
        """The modeled pipeline fill and drain, a share of all IPU time."""
        return self.view.bubble

    @property
    def host_calls_per_epoch(self) -> int:
        return self.view.host_calls_per_epoch

    # -- costs -------------------------------------------------------------------------
    def costs_for(self, config: Config) -> logic.CostTable:
        """The cost table of ``config``'s model at its micro-batch size, calibrated on this
        machine the first time it is needed (:func:`~ipukit.widgets.logic.calibrated_costs`)."""
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
