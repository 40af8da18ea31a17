"""``PipelineExplorer``: the ipywidgets dashboard over :mod:`ipukit.widgets.logic`.

The explorer puts four parts together, each in its own module:

* :class:`~ipukit.widgets.controls.Controls` — the controls and the
  :class:`~ipukit.widgets.logic.Config` they describe (model, batching, the
  stage split or, for the ViT, ``layers_per_ipu``, schedule, output mode);
* :class:`~ipukit.widgets.dashboard.Dashboard` — the figures, text and buttons;
* :class:`~ipukit.widgets.modeler.Modeler` — the modeled call, from the cost
  table calibrated on this machine, and ipukit's verdict on the configuration (compiled in the background
  by a :class:`~ipukit.widgets.prober.Prober`) with the memory it needs;
* :class:`~ipukit.widgets.runner.Runner` — Run, Stop and New model: real
  training on a background thread;
* :class:`~ipukit.widgets.suggester.Suggester` — a memory budget and Suggest:
  :func:`ipukit.plan` for the current model, IPUs and global batch, applied to the controls.

A control change models the call at once (:func:`~ipukit.widgets.logic.modeled_view`)
and asks for the verdict. Every control, figure and button is an
attribute of the explorer, so notebooks and tests drive it from code::

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
from .dashboard import Dashboard, update_figure  # noqa: F401 - update_figure: public here too
from .data import ExplorerData
from .logic import Config
from .models import by_name
from .modeler import Modeler
from .runner import Runner
from .session import TrainingSession
from .suggester import Suggester


class PipelineExplorer:
    """A dashboard to explore a pipelined model: modeled instantly, measured on demand.

    ``models`` are the model specs the model control offers, the first shown first:
    objects with the attributes of :class:`ipukit.examples.spec.ModelSpec`, e.g.
    ``[ipukit.examples.mnist.explorer_model(), ipukit.examples.vit.explorer_model()]``
    (a model of your own: ``ModelSpec(name, blocks, factory, wrap)``). Each model's
    cost table is calibrated on this machine when first shown (:func:`ipukit.calibrate`).
    ``train_dataset``/``test_dataset`` default to real MNIST, loaded on the first run
    (``train_limit``/``test_limit`` keep the first samples); ``sample_shape`` is one
    input's shape, to compile without data. ``config`` holds the starting control
    values, ``calls`` the host calls per Run.
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
        self.runner = Runner(self.dashboard, self.models, self.data, self._lock, self._measured,
                             self._show_error, self.modeler.costs_for, evaluate, test_limit)
        self.dashboard.run_button.on_click(lambda _: self.start())
        self.dashboard.stop_button.on_click(lambda _: self.stop())
        self.dashboard.reset_button.on_click(lambda _: self.reset())
        self.refresh()

    # -- the parts' public attributes are the explorer's (controls, figures, buttons,
    #    modeled_utilisation, history, measured_utilisation, running, stop, wait, ...) ----
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
        """Show the dashboard (the explorer also displays itself as a cell's last value)."""
        from IPython.display import display

        display(self.widget)

    # -- the configuration -------------------------------------------------------------
    @property
    def config(self) -> Config:
        """The :class:`Config` the controls currently describe (raises ipukit.Error when
        ``layers_per_ipu`` does not fit the model)."""
        return self.controls.config

    @property
    def model(self):
        """The model control (``explorer.model.value``: ``"convnet"`` or ``"ViT"``)."""
        return self.controls.model

    def set(self, **values) -> None:
        """Set several controls at once, refreshing once: ``explorer.set(gradient_accumulation=16)``.

        Names are the control attributes; ``sharded=True`` sets the execution,
        ``layers_per_ipu`` takes a list or a text.
        """
        self.controls.set(**values)
        self.runner.run_error = None
        self.refresh()

    def _on_change(self, change) -> None:
        self.runner.run_error = None        # it was about the previous settings
        self.refresh()

    # -- the modeled view --------------------------------------------------------------
    def refresh(self) -> None:
        """Model the current controls at once; ipukit's verdict follows (see :meth:`wait_for_verdict`)."""
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

    def wait_for_verdict(self, timeout: Optional[float] = 120.0) -> Optional[logic.ProbeResult]:
        """Block until ipukit's verdict on the current controls is shown; returns it."""
        return self.modeler.wait_for_verdict(timeout)

    def _show_error(self) -> None:
        runner = self.runner
        if runner.run_error and runner.failed:
            self.dashboard.show_error(runner.run_error, failed=True)
        else:
            self.dashboard.show_error(runner.run_error or self.modeler.config_error)

    # -- read-back ---------------------------------------------------------------------
    @property
    def last_error(self) -> Optional[str]:
        """The message shown in the error box (None when there is none); waits for the
        verdict on the current controls."""
        if self.runner.run_error:
            return self.runner.run_error
        self.wait_for_verdict()
        return self.modeler.config_error

    @property
    def probe_result(self) -> Optional[logic.ProbeResult]:
        """ipukit's verdict on the current controls (waits for it)."""
        return self.wait_for_verdict()

    @property
    def modeled(self) -> logic.ModeledView:
        """The modeled view of the current controls."""
        return self.modeler.view

    @property
    def costs(self) -> logic.CostTable:
        """The cost table the modeled view uses: the current model's, calibrated on this
        machine at the current micro-batch size (a Run does not change it)."""
        return self.modeler.costs

    @property
    def session(self) -> TrainingSession:
        """The training session of the current model."""
        return self.runner.session_for(self.controls.model.value)

    # -- running -----------------------------------------------------------------------
    def _measured(self, config: Config, record: Dict[str, Any]) -> None:
        self.refresh()          # the modeled view keeps its calibrated costs

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
        """Train for ``calls`` host calls and return when done, with the new history records.

        The training runs on the thread the Run button starts; this call waits
        for it (interrupting the kernel stops the run after the current call).
        Errors are shown in the dashboard (and in :attr:`last_error`), not raised.
        """
        if self.running:
            raise RuntimeError("a run is already in progress: call stop() first")
        before = len(self.runner.history)
        self.start(calls)
        self.runner.join_interruptibly()
        return self.runner.history[before:]

    def redraw(self) -> None:
        """Send every figure to the front end again, after ipukit's verdict is in.

        For a notebook that drives the dashboard from code right after displaying it:
        a FigureWidget view still being created in the browser can miss updates.
        """
        self.wait_for_verdict()
        self.refresh()
        self.dashboard.redraw()

    def close(self) -> None:
        """Stop any run and close the widgets."""
        self.stop(wait=True)
        self.modeler.wait_for_verdict()
        self.widget.close()
