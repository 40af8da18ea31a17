"""``PipelineExplorer``: the ipywidgets dashboard over :mod:`ipukit.widgets.logic`.

This layer only wires widgets to the logic: a control change builds a
:class:`~ipukit.widgets.logic.Config`, asks the logic for the modeled view and
for ipukit's verdict on the combination, and copies the resulting figures
into ``go.FigureWidget`` objects. The Run button hands the configuration to a
:class:`~ipukit.widgets.session.TrainingSession` on a background thread; Stop
ends it between two calls.

Every control and figure is an attribute, so notebooks and tests can drive
the dashboard from code::

    explorer = PipelineExplorer()
    explorer.gradient_accumulation.value = 32
    explorer.modeled_utilisation          # {ipu: fraction}
    explorer.run(calls=3)                 # synchronous training
    explorer.measured_utilisation
"""
from __future__ import annotations

import threading
import traceback
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import ipywidgets as W
import plotly.graph_objects as go
import torch

from .. import plots
from ..errors import Error
from . import logic
from .logic import Config
from .session import TrainingSession

_PROBE_CACHE_SIZE = 64
_MNIST_SAMPLES = 60000


def update_figure(widget: go.FigureWidget, figure: go.Figure) -> None:
    """Replace a FigureWidget's traces and layout with those of ``figure``, in one update.

    The widget keeps its own width and height: plotly's front end does not size a
    FigureWidget to its box (it falls back to 700 px), so the explorer sets sizes.
    """
    width, height = widget.layout.width, widget.layout.height
    with widget.batch_update():
        widget.data = []
        widget.add_traces(list(figure.data))
        widget.layout = figure.layout
        widget.layout.width = width
        widget.layout.height = height


def _default_datasets(train_limit, test_limit):
    from ..datasets import mnist_tensors

    return (lambda: mnist_tensors(train=True, limit=train_limit),
            lambda: mnist_tensors(train=False, limit=test_limit))


class PipelineExplorer:
    """A dashboard to explore a pipelined model: modeled instantly, measured on demand.

    Parameters
    ----------
    model_factory:
        Builds the network (default: the tutorial's MNIST ``Network``).
    train_dataset, test_dataset:
        Datasets of ``(input, label)`` pairs (default: real MNIST via
        :func:`ipukit.datasets.mnist_tensors`, loaded on the first run, from
        ``IPUKIT_DATA``). ``train_limit``/``test_limit`` keep the first samples.
    wrap:
        Adds the loss to the network, in the last block (default:
        ``ipukit.examples.mnist.TrainingModelWithLoss``).
    blocks:
        The block names, in order (default B1–B4).
    sample_shape:
        Shape of one input sample, used to compile configurations without
        data (default: taken from the training set, else ``(1, 28, 28)``).
    config:
        Initial control values (a :class:`~ipukit.widgets.logic.Config`).
    calls:
        Host calls per Run (the Run button; :meth:`run` takes its own).
    """

    def __init__(self, model_factory: Optional[Callable[[], torch.nn.Module]] = None,
                 train_dataset=None, test_dataset=None, *,
                 wrap: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
                 blocks=None, sample_shape=None, config: Optional[Config] = None,
                 calls: int = 20, train_limit: Optional[int] = None,
                 test_limit: Optional[int] = None, evaluate: bool = True) -> None:
        from ..examples import mnist

        self.model_factory = model_factory or mnist.Network
        self.wrap = wrap or mnist.TrainingModelWithLoss
        self.blocks = tuple(blocks or mnist.BLOCKS)
        self._train_dataset = train_dataset
        self._test_dataset = test_dataset
        self._load_train, self._load_test = _default_datasets(train_limit, test_limit)
        self._train_limit, self._test_limit = train_limit, test_limit
        self._sample_shape = tuple(sample_shape) if sample_shape is not None else None
        self.evaluate_after_run = evaluate
        self.splits = logic.contiguous_splits(self.blocks)
        self.config0 = config or Config(blocks=self.blocks, split=next(iter(self.splits)))
        self.costs = logic.default_costs(self.blocks, self.config0.micro_batch_size)
        self._probe_network: Optional[torch.nn.Module] = None
        self._probes: "OrderedDict[Config, logic.ProbeResult]" = OrderedDict()
        self._session: Optional[TrainingSession] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._suspend = False
        self.history: List[Dict[str, Any]] = []
        self.test_accuracy: Optional[float] = None
        self.measured_timeline = None
        self.modeled: Optional[logic.ModeledView] = None
        self.probe_result: Optional[logic.ProbeResult] = None
        self._config_error: Optional[str] = None
        self._run_error: Optional[str] = None
        self._run_failed = False            # the run error is not an ipukit.Error
        self._build_widgets(calls)
        self.refresh()

    # -- widgets -------------------------------------------------------------------------
    def _build_widgets(self, calls: int) -> None:
        c = self.config0
        style = {"description_width": "150px"}
        wide = W.Layout(width="420px")
        slider = dict(continuous_update=False, style=style, layout=wide)
        self.device_iterations = W.IntSlider(value=c.device_iterations, min=1, max=64,
                                             description="device iterations", **slider)
        self.gradient_accumulation = W.IntSlider(value=c.gradient_accumulation, min=1, max=64,
                                                 description="gradient accumulation", **slider)
        self.micro_batch_size = W.IntSlider(value=c.micro_batch_size, min=1, max=128,
                                            description="micro-batch size", **slider)
        self.split = W.Dropdown(options=list(self.splits), value=c.split,
                                description="stage split", style=style, layout=wide)
        self.execution = W.ToggleButtons(options=list(logic.EXECUTIONS),
                                         value="sharded" if c.sharded else "pipelined",
                                         description="execution", style=style)
        self.schedule = W.ToggleButtons(options=list(logic.SCHEDULES), value=c.schedule,
                                        description="schedule", style=style)
        self.output_mode = W.Dropdown(options=list(logic.OUTPUT_MODES), value=c.output_mode,
                                      description="output mode", style=style, layout=wide)
        self.output_return_period = W.IntSlider(value=c.output_return_period, min=1, max=16,
                                                description="EveryN period", **slider)
        self.offload = W.Checkbox(value=c.offload_optimizer, description="offload optimiser state",
                                  indent=False)
        self.calls = W.BoundedIntText(value=calls, min=1, max=100000, description="calls per run",
                                      style=style, layout=W.Layout(width="260px"))
        self.controls = [self.device_iterations, self.gradient_accumulation,
                         self.micro_batch_size, self.split, self.execution, self.schedule,
                         self.output_mode, self.output_return_period, self.offload]
        for w in self.controls:
            w.observe(self._on_change, names="value")

        self.error = W.HTML(value="")
        self.summary = W.HTML(value="")
        self.status = W.HTML(value="Not run yet: press Run to train for real.")
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.reset_button = W.Button(description="New model", icon="refresh",
                                     tooltip="Start again from freshly initialised weights")
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        self.reset_button.on_click(lambda _: self.reset())

        def fig(height, width):
            return go.FigureWidget(layout=dict(height=height, width=width,
                                               template="plotly_white"))

        full, part = 1000, 500
        self.modeled_timeline_figure = fig(300, full)
        self.modeled_utilisation_figure = fig(320, part)
        self.memory_figure = fig(360, part)
        self.measured_timeline_figure = fig(300, full)
        self.measured_utilisation_figure = fig(320, part)
        self.training_figure = fig(320, part)
        self.figures = {"modeled timeline": self.modeled_timeline_figure,
                        "modeled utilisation": self.modeled_utilisation_figure,
                        "memory": self.memory_figure,
                        "measured timeline": self.measured_timeline_figure,
                        "measured utilisation": self.measured_utilisation_figure,
                        "training": self.training_figure}
        half = W.Layout(width=f"{part + 10}px")
        full_box = W.Layout(width=f"{full + 10}px")
        self.modeled_box = W.VBox([
            W.HTML("<h3>Modeled — updates as you move a control (no training)</h3>"),
            self.summary, W.Box([self.modeled_timeline_figure], layout=full_box),
            W.HBox([W.Box([self.modeled_utilisation_figure], layout=half),
                    W.Box([self.memory_figure], layout=half)])])
        self.measured_box = W.VBox([
            W.HTML("<h3>Measured — real training with ipukit</h3>"),
            W.HBox([self.run_button, self.stop_button, self.reset_button, self.calls]),
            self.status,
            W.HBox([W.Box([self.measured_utilisation_figure], layout=half),
                    W.Box([self.training_figure], layout=half)]),
            W.Box([self.measured_timeline_figure], layout=full_box)])
        left = W.VBox([self.device_iterations, self.gradient_accumulation, self.micro_batch_size,
                       self.split, self.output_mode, self.output_return_period])
        right = W.VBox([self.execution, self.schedule, self.offload])
        self.widget = W.VBox([W.HBox([left, right]), self.error, self.modeled_box,
                              self.measured_box])
        update_figure(self.training_figure, plots.loss_accuracy_figure([]))

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self):
        """Show the dashboard (the explorer also displays itself as a cell's last value)."""
        from IPython.display import display

        display(self.widget)

    # -- the configuration ---------------------------------------------------------------
    @property
    def config(self) -> Config:
        """The :class:`Config` the controls currently describe."""
        return Config(device_iterations=self.device_iterations.value,
                      gradient_accumulation=self.gradient_accumulation.value,
                      micro_batch_size=self.micro_batch_size.value,
                      split=self.split.value, output_mode=self.output_mode.value,
                      output_return_period=self.output_return_period.value,
                      sharded=self.execution.value == "sharded",
                      schedule=self.schedule.value, offload_optimizer=self.offload.value,
                      learning_rate=self.config0.learning_rate, blocks=self.blocks)

    def set(self, **values) -> None:
        """Set several controls at once, refreshing once: ``explorer.set(gradient_accumulation=16)``.

        Names are the control attributes; ``sharded=True`` sets the execution.
        """
        if "sharded" in values:
            values["execution"] = "sharded" if values.pop("sharded") else "pipelined"
        self._suspend = True
        try:
            for name, value in values.items():
                widget = getattr(self, name)
                if widget not in self.controls:
                    raise AttributeError(f"{name!r} is not a control of the explorer")
                widget.value = value
        finally:
            self._suspend = False
        self._run_error = None
        self.refresh()

    def _on_change(self, change) -> None:
        if not self._suspend:
            self._run_error = None          # it was about the previous settings
            self.refresh()

    # -- data ----------------------------------------------------------------------------
    @property
    def train_dataset(self):
        if self._train_dataset is None:
            self._train_dataset = self._load_train()
        return self._train_dataset

    @property
    def test_dataset(self):
        if self._test_dataset is None and self.evaluate_after_run:
            self._test_dataset = self._load_test()
        return self._test_dataset

    @property
    def samples_per_epoch(self) -> int:
        if self._train_dataset is not None:
            return len(self._train_dataset)
        return self._train_limit or _MNIST_SAMPLES

    def _template(self) -> List[torch.Tensor]:
        if self._sample_shape is not None:
            return [torch.zeros(self._sample_shape), torch.zeros((), dtype=torch.long)]
        if self._train_dataset is not None:
            x, y = self._train_dataset[0]
            return [torch.zeros_like(torch.as_tensor(x)), torch.zeros_like(torch.as_tensor(y))]
        return [torch.zeros(1, 28, 28), torch.zeros((), dtype=torch.long)]

    # -- the modeled view ----------------------------------------------------------------
    def _probe(self, config: Config) -> logic.ProbeResult:
        key = config.with_(learning_rate=0.0)
        hit = self._probes.get(key)
        if hit is not None:
            self._probes.move_to_end(key)
            return hit
        if self._probe_network is None:
            self._probe_network = self.model_factory()
        result = logic.probe(config, self._probe_network, self.wrap, self._template())
        self._probes[key] = result
        while len(self._probes) > _PROBE_CACHE_SIZE:
            self._probes.popitem(last=False)
        return result

    def refresh(self) -> None:
        """Recompute the modeled view and ipukit's verdict for the current controls."""
        with self._lock:
            config = self.config
            self.output_return_period.disabled = config.output_mode != "EveryN"
            self.schedule.disabled = config.sharded
            result = self._probe(config)
            self.probe_result = result
            self._config_error = result.error
            view = logic.modeled_view(config, self.costs, self.samples_per_epoch,
                                      parameters=result.parameters)
            self.modeled = view
            suffix = " — PopTorch rejects this configuration" if result.error else ""
            title = view.title + suffix
            if view.drawn_note:
                title += f" ({view.drawn_note})"
            update_figure(self.modeled_timeline_figure,
                          plots.timeline_figure(view.drawn, title=title, show_micro_batches=True))
            update_figure(self.modeled_utilisation_figure,
                          plots.utilisation_figure(view.timeline,
                                                   title="Utilisation per virtual IPU"))
            if result.report is not None:
                update_figure(self.memory_figure, plots.memory_figure(result.report))
            self.summary.value = logic.format_summary(view)
            self._show_error()

    def _show_error(self) -> None:
        if self._run_error and self._run_failed:
            self.error.value = logic.error_html(self._run_error, heading="The run failed:")
        else:
            self.error.value = logic.error_html(self._run_error or self._config_error)

    # -- read-back -----------------------------------------------------------------------
    @property
    def last_error(self) -> Optional[str]:
        """The message shown in the error box (None when there is none)."""
        return self._run_error or self._config_error

    @property
    def modeled_utilisation(self) -> Dict[int, float]:
        """Modeled busy fraction of each virtual IPU for the current controls."""
        return dict(self.modeled.utilisation)

    @property
    def modeled_overall(self) -> float:
        return self.modeled.overall

    @property
    def bubble(self) -> float:
        return self.modeled.bubble

    @property
    def host_calls_per_epoch(self) -> int:
        return self.modeled.host_calls_per_epoch

    @property
    def measured_utilisation(self) -> Dict[int, float]:
        """Busy fraction of each virtual IPU in the latest measured call ({} before a run)."""
        return logic.utilisation_record(self.measured_timeline)["per_ipu"]

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- running -------------------------------------------------------------------------
    @property
    def session(self) -> TrainingSession:
        if self._session is None:
            self._session = TrainingSession(self.model_factory, self.wrap, self.train_dataset,
                                            self.test_dataset)
        return self._session

    def reset(self) -> None:
        """Forget the training: fresh weights, empty curves."""
        if self.running:
            self.stop(wait=True)
        if self._session is not None:
            self._session.reset()
        self.history = []
        self.test_accuracy = None
        self.measured_timeline = None
        self.costs = logic.default_costs(self.blocks, self.micro_batch_size.value)
        update_figure(self.training_figure, plots.loss_accuracy_figure([]))
        self.status.value = "New model: press Run to train."
        self.refresh()

    def start(self, calls: Optional[int] = None) -> None:
        """Train in the background (what the Run button does); returns at once."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_safely,
                                        args=(self.config, calls or self.calls.value),
                                        name="ipukit-explorer", daemon=True)
        self._set_running(True)
        self._thread.start()

    def stop(self, wait: bool = True, timeout: Optional[float] = 60.0) -> None:
        """Ask the run to stop after the current call (what the Stop button does)."""
        self._stop.set()
        if wait:
            self.wait(timeout)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until a background run has finished."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def run(self, calls: Optional[int] = None) -> List[Dict[str, Any]]:
        """Train for ``calls`` host calls and return when done, with the new history records.

        The training runs on the same thread the Run button starts (so both
        behave alike); this call waits for it. Interrupting the kernel stops
        the run after the current call. Errors are shown in the dashboard (and
        in :attr:`last_error`), not raised.
        """
        if self.running:
            raise RuntimeError("a run is already in progress: call stop() first")
        before = len(self.history)
        self.start(calls)
        try:
            while self.running:
                self._thread.join(0.1)
        except KeyboardInterrupt:
            self.stop(wait=True)
            raise
        return self.history[before:]

    def _set_running(self, running: bool) -> None:
        self.run_button.disabled = running
        self.reset_button.disabled = running
        self.stop_button.disabled = not running

    def _run_safely(self, config: Config, calls: int) -> None:
        self._run_error = None
        self._run_failed = False
        self._show_error()
        before = len(self.history)
        try:
            self._train(config, calls)
        except Error as exc:
            self._run_error = logic.check_message(exc)
            done = len(self.history) - before
            self.status.value = (f"The run stopped after {done} calls: see the message above."
                                 if done else "The run did not start: see the message above.")
        except Exception as exc:  # noqa: BLE001 - shown in the dashboard, never a dead thread
            self._run_error = logic.check_message(exc)
            self._run_failed = True
            self.status.value = "<pre>" + traceback.format_exc(limit=3) + "</pre>"
        finally:
            self._show_error()
            if threading.current_thread() is self._thread:
                self._set_running(False)

    def _train(self, config: Config, calls: int) -> None:
        session = self.session
        self.status.value = f"Compiling and training: {config.describe()}…"
        record = None
        # Compiling traces the model with a process-wide block recorder: never at the same
        # time as a probe compiling another configuration, hence the lock.
        for record in session.run(config, calls, self._stop, compile_lock=self._lock):
            self._record(record)
        if record is None:
            self.status.value = "Stopped before the first call."
            return
        self.costs = logic.costs_from_run(self.measured_timeline, config,
                                          source=f"costs measured in call {record['call']}")
        self.refresh()
        stopped = " (stopped)" if self._stop.is_set() else ""
        text = (f"Trained {len(self.history)} calls in all{stopped}; last call "
                f"{record['seconds']:.2f} s, {record['samples_per_s']:,.0f} samples/s.")
        if self.evaluate_after_run and self.test_dataset is not None:
            self.status.value = text + " Testing…"
            self.test_accuracy = session.evaluate(config, self._test_limit, compile_lock=self._lock)
            if self.test_accuracy is not None:
                text += f" Test accuracy {self.test_accuracy:.2f}%."
                self.history[-1]["test_accuracy"] = self.test_accuracy
        self.status.value = text

    def _record(self, record: Dict[str, Any]) -> None:
        timeline = record.pop("timeline")
        config = record["config"]
        self.measured_timeline = timeline
        u = logic.utilisation_record(timeline)
        record["utilisation"] = u["per_ipu"]
        record["overall"] = u["overall"]
        self.history.append(record)
        acc = "—" if record["accuracy"] is None else f"{record['accuracy']:.1f}%"
        self.status.value = (f"Call {record['call']}: loss {record['loss']:.4f}, training "
                             f"accuracy {acc} from {record['predictions']:,} of "
                             f"{record['combined_batch']:,} samples ({config.resolved_output_mode}"
                             f" output), {record['samples_per_s']:,.0f} samples/s.")
        drawn, note = logic.clip_for_drawing(timeline)
        title = f"Latest call (call {record['call']})" + (f" ({note})" if note else "")
        self._measured_figures = {
            "measured utilisation": plots.utilisation_figure(
                timeline, title=f"Utilisation per virtual IPU (call {record['call']})"),
            "training": plots.loss_accuracy_figure(self.history),
            "measured timeline": plots.timeline_figure(drawn, title=title)}
        for name, figure in self._measured_figures.items():
            update_figure(self.figures[name], figure)

    def redraw(self) -> None:
        """Send every figure to the front end again.

        For a notebook that drives the dashboard from code right after displaying it:
        a FigureWidget view still being created in the browser can miss updates.
        """
        self.refresh()
        for name, figure in getattr(self, "_measured_figures", {}).items():
            update_figure(self.figures[name], figure)

    def close(self) -> None:
        """Stop any run and close the widgets."""
        self.stop(wait=True)
        self.widget.close()
