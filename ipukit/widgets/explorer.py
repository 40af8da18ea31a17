"""``PipelineExplorer``: the ipywidgets dashboard over :mod:`ipukit.widgets.logic`.

Its parts: :class:`~ipukit.widgets.controls.Controls` (the controls and their
:class:`~ipukit.widgets.logic.Config`), :class:`~ipukit.widgets.dashboard.Dashboard`
(figures, text, buttons), :class:`~ipukit.widgets.modeler.Modeler` (the modeled call and
ipukit's verdict), :class:`~ipukit.widgets.runner.Runner` (Run, Stop, New model) and
:class:`~ipukit.widgets.suggester.Suggester` (Suggest: :func:`ipukit.plan`). A control
change models the call at once and asks for the verdict. Every control, figure and
button is an attribute of the explorer, so code drives it::

    explorer = PipelineExplorer([mnist.explorer_model(), vit.explorer_model()])  # ipukit.examples'
    explorer.gradient_accumulation.value = 32
    explorer.modeled_utilisation          # {ipu: fraction}
    explorer.set(model="ViT", layers_per_ipu="3, 3, 1, 1")
    explorer.run(calls=3)                 # synchronous training
    explorer.measured_utilisation
    explorer.suggest(budget_mib=4)        # ipukit.plan's plan, applied to the controls
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence

from ..core.errors import Error
from . import logic
from .controls import Controls
from .dashboard import Dashboard
from .data import ExplorerData
from .logic import Config
from .models import by_name
from .modeler import Modeler
from .runner import Runner
from .suggester import Suggester


class PipelineExplorer:
    """A dashboard to explore a pipelined model: modeled instantly, measured on demand.

    ``models`` are model specs (:class:`ipukit.examples.spec.ModelSpec`, e.g.
    ``ipukit.examples.mnist.explorer_model()``), the first shown first; each one's costs
    are calibrated on this machine when first shown. The datasets default to real MNIST
    (``train_limit``/``test_limit`` keep the first samples); ``sample_shape`` is one
    input's shape, ``config`` the starting control values, ``calls`` the calls per Run.
    """

    def __init__(self, models: Sequence[Any], train_dataset=None, test_dataset=None, *,
                 sample_shape=None, config: Optional[Config] = None, calls: int = 20,
                 train_limit: Optional[int] = None, test_limit: Optional[int] = None,
                 evaluate: bool = True) -> None:
        self.models = by_name(models)
        first = next(iter(self.models.values()))
        self.config0 = config or logic.example_config(first)
        if self.config0.model not in self.models:           # a config written for another model
            self.config0 = logic.example_config(first)
        self.data = ExplorerData(train_dataset, test_dataset, train_limit, test_limit,
                                 sample_shape, evaluate)
        self._lock = threading.RLock()
        self.controls = Controls(self.models, self.config0, self._on_change)
        self.suggester = Suggester(self.models, lambda: self.controls.config,
                                   lambda c: self.modeler.costs_for(c), self.set)
        self.dashboard = Dashboard(self.suggester.under(self.controls.box), calls)
        self.widget = self.dashboard.widget
        self.modeler = Modeler(self.models, self.dashboard, self.data, self._lock, self.config0,
                               self._show_error)
        self.runner = Runner(self.dashboard, self.models, self.data, self._lock,
                             lambda config, record: self.refresh(), self._show_error,
                             self.modeler.costs_for, evaluate, test_limit)
        self.dashboard.run_button.on_click(lambda _: self.start())
        self.dashboard.stop_button.on_click(lambda _: self.stop())
        self.dashboard.reset_button.on_click(lambda _: self.reset())
        self.refresh()

    def _on_change(self, change) -> None:
        """A control moved (in the browser or from code): model the new settings."""
        self.set()

    # -- the parts' public attributes are the explorer's ---------------------------------
    def __getattr__(self, name: str):
        for part in ("controls", "dashboard", "modeler", "runner", "data", "suggester"):
            holder = self.__dict__.get(part)
            if holder is not None and not name.startswith("_") and hasattr(holder, name):
                return getattr(holder, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name == "evaluate_after_run" and "runner" in self.__dict__:
            self.runner.evaluate_after_run = self.data.evaluate = value
        else:
            super().__setattr__(name, value)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self):
        """Show the dashboard."""
        from IPython.display import display

        display(self.widget)

    # -- the configuration -------------------------------------------------------------
    @property
    def config(self) -> Config:
        """The :class:`Config` of the controls (ipukit.Error when ``layers_per_ipu`` does not fit)."""
        return self.controls.config

    def set(self, **values) -> None:
        """Set several controls, refreshing once: ``explorer.set(gradient_accumulation=16)``
        (``sharded=True`` sets the execution, ``layers_per_ipu`` takes a list or a text)."""
        self.controls.set(**values)
        self.runner.run_error = None
        self.refresh()

    # -- the modeled view --------------------------------------------------------------
    def refresh(self) -> None:
        """Model the current controls at once; ipukit's verdict follows."""
        try:
            config = self.controls.config
        except (Error, ValueError) as exc:
            self.modeler.reject(logic.check_message(exc))       # the last modeled view stays
            self._show_error()
            return
        previous = self.modeler.config
        if previous is not None and config.model != previous.model:
            self.stop(wait=True)
            self.runner.forget()
            self.dashboard.status.value = f"{config.model}: press Run to train it."
        self.controls.sync(config)
        self.modeler.show(config)
        self._show_error()

    def _show_error(self) -> None:
        r = self.runner
        self.dashboard.show_error(r.run_error or self.modeler.config_error,
                                  failed=bool(r.run_error and r.failed))

    # -- read-back ---------------------------------------------------------------------
    @property
    def last_error(self) -> Optional[str]:
        """The error box's message (None: none); waits for the verdict."""
        if self.runner.run_error:
            return self.runner.run_error
        self.wait_for_verdict()
        return self.modeler.config_error

    #: ipukit's verdict on the current controls (waits for it)
    probe_result = property(lambda self: self.wait_for_verdict())
    #: the modeled view of the current controls
    modeled = property(lambda self: self.modeler.view)
    #: the current model's :class:`~ipukit.widgets.session.TrainingSession`
    session = property(lambda self: self.runner.session_for(self.controls.model.value))

    # -- running -----------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the training of the current model: fresh weights, empty curves."""
        if self.running:
            self.stop(wait=True)
        self.runner.forget(self.controls.model.value)
        self.dashboard.status.value = "New model: press Run to train."
        self.refresh()

    def start(self, calls: Optional[int] = None) -> None:
        """Train in the background (what the Run button does); returns at once."""
        try:
            config = self.config
        except (logic.Error, ValueError) as exc:
            self.runner.run_error = logic.check_message(exc)
            self._show_error()
            return
        self.runner.start(config, calls or self.dashboard.calls.value)

    def run(self, calls: Optional[int] = None) -> List[Dict[str, Any]]:
        """Train for ``calls`` host calls on the Run thread and wait; returns the new history
        records. Errors are shown (and in :attr:`last_error`), not raised."""
        if self.running:
            raise RuntimeError("a run is already in progress: call stop() first")
        before = len(self.runner.history)
        self.start(calls)
        self.runner.join_interruptibly()
        return self.runner.history[before:]

    def redraw(self) -> None:
        """Model the controls again once ipukit's verdict is in, and send every figure to the
        front end again, whole."""
        self.wait_for_verdict()
        self.refresh()
        self.dashboard.redraw()

    def close(self) -> None:
        """Stop any run and close the widgets."""
        self.stop(wait=True)
        self.modeler.wait_for_verdict()
        self.widget.close()
