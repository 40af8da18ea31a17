"""The explorer's controls: the widgets a reader moves, and the :class:`Config` they describe.

:class:`Controls` builds the sliders, drop-downs and toggles, shows the stage
control that fits the chosen model (a stage split for the convnet, an
IPUConfig's ``layers_per_ipu`` for the ViT), and turns the current values into
a :class:`~ipukit.widgets.logic.Config`. It calls one function when any value
changes and knows nothing of figures or training.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, List

from ..core.errors import needs_extra

with needs_extra("notebooks", "ipukit.widgets"):
    import ipywidgets as W

from . import logic
from .logic import Config
from .models import parse_layers

_STYLE = {"description_width": "150px"}


def _wide() -> W.Layout:
    """A layout of its own per control (a shared one would hide them all at once)."""
    return W.Layout(width="420px")


def _layers_text(layers) -> str:
    return ", ".join(str(n) for n in layers)


class Controls:
    """Every control of the explorer, as attributes named like :class:`Config`'s fields.

    ``models`` maps a name to a model spec (see :mod:`ipukit.widgets.models`);
    ``config`` holds the starting values; ``on_change(change)`` is called after
    every change made in the browser or from code (not inside :meth:`suspended`).
    """

    def __init__(self, models: Dict[str, Any], config: Config,
                 on_change: Callable) -> None:
        self.models = models
        self.learning_rate = config.learning_rate
        self.splits = logic.contiguous_splits(config.blocks)
        slider = dict(continuous_update=False, style=_STYLE)
        self.model = W.Dropdown(options=list(models), value=config.model, description="model",
                                style=_STYLE, layout=_wide(), disabled=len(models) < 2)
        self.device_iterations = W.IntSlider(value=config.device_iterations, min=1, max=64,
                                             description="device iterations", layout=_wide(), **slider)
        self.gradient_accumulation = W.IntSlider(value=config.gradient_accumulation, min=1,
                                                 max=64, description="gradient accumulation",
                                                 layout=_wide(), **slider)
        self.micro_batch_size = W.IntSlider(value=config.micro_batch_size, min=1, max=128,
                                            description="micro-batch size", layout=_wide(), **slider)
        self.split = W.Dropdown(options=list(self.splits), value=config.split,
                                description="stage split", style=_STYLE, layout=_wide())
        model = models[config.model]
        self.layers_per_ipu = W.Combobox(
            value=_layers_text(config.layers_per_ipu or model.default_layers),
            options=list(model.presets), ensure_option=False, continuous_update=False,
            description="layers per IPU", placeholder="e.g. 2, 2, 2, 2 (-1: share the rest)",
            style=_STYLE, layout=_wide())
        self.execution = W.ToggleButtons(options=list(logic.EXECUTIONS),
                                         value="sharded" if config.sharded else "pipelined",
                                         description="execution", style=_STYLE)
        self.schedule = W.Dropdown(options=list(logic.SCHEDULES), value=config.schedule,
                                   description="schedule", style=_STYLE, layout=_wide())
        self.output_mode = W.Dropdown(options=list(logic.OUTPUT_MODES), value=config.output_mode,
                                      description="output mode", style=_STYLE, layout=_wide())
        self.output_return_period = W.IntSlider(value=config.output_return_period, min=1,
                                                max=16, description="EveryN period", layout=_wide(),
                                                **slider)
        self.offload = W.Checkbox(value=config.offload_optimizer,
                                  description="offload optimiser state", indent=False)
        self.widgets: List[W.Widget] = [
            self.model, self.device_iterations, self.gradient_accumulation,
            self.micro_batch_size, self.split, self.layers_per_ipu, self.execution,
            self.schedule, self.output_mode, self.output_return_period, self.offload]
        self._suspend = False
        self._on_change = on_change
        for w in self.widgets:
            w.observe(self._changed, names="value")
        self.box = W.HBox([
            W.VBox([self.model, self.device_iterations, self.gradient_accumulation,
                    self.micro_batch_size, self.split, self.layers_per_ipu, self.output_mode,
                    self.output_return_period]),
            W.VBox([self.execution, self.schedule, self.offload])])
        self.show_model(model)

    # -- values ------------------------------------------------------------------------
    @property
    def current_model(self):
        return self.models[self.model.value]

    @property
    def config(self) -> Config:
        """The :class:`Config` the controls describe.

        For a model placed by ``layers_per_ipu``, the split is where the model's
        ``parallelize`` put its blocks; a text that does not parse, or counts that
        do not fit the model, raise :class:`ipukit.Error` with the reason. The
        stages go on the IPUs the schedule wants (:func:`~ipukit.widgets.logic.placed`:
        a ``ValueError`` when they cannot, e.g. an odd number of stages for ZBV).
        """
        model = self.current_model
        values = dict(device_iterations=self.device_iterations.value,
                      gradient_accumulation=self.gradient_accumulation.value,
                      micro_batch_size=self.micro_batch_size.value,
                      output_mode=self.output_mode.value,
                      output_return_period=self.output_return_period.value,
                      sharded=self.execution.value == "sharded", schedule=self.schedule.value,
                      offload_optimizer=self.offload.value, learning_rate=self.learning_rate,
                      blocks=model.blocks, model=model.name)
        if not model.layered:
            return logic.placed(Config(split=self.split.value, **values))
        values.pop("blocks"), values.pop("model")
        return logic.example_config(model, layers_per_ipu=parse_layers(
            self.layers_per_ipu.value, model), **values)

    def set(self, **values) -> None:
        """Set several controls at once, without a change call per control."""
        if "sharded" in values:
            values["execution"] = "sharded" if values.pop("sharded") else "pipelined"
        if "model" in values:                       # first: it decides the other controls
            values = {"model": values.pop("model"), **values}
        if isinstance(values.get("layers_per_ipu"), (list, tuple)):
            values["layers_per_ipu"] = _layers_text(values["layers_per_ipu"])
        with self.suspended():
            for name, value in values.items():
                widget = getattr(self, name, None)
                if widget not in self.widgets:
                    raise AttributeError(f"{name!r} is not a control of the explorer")
                widget.value = value

    @contextmanager
    def suspended(self):
        """Changes made inside do not call ``on_change``."""
        self._suspend, before = True, self._suspend
        try:
            yield
        finally:
            self._suspend = before

    def _changed(self, change) -> None:
        if change["owner"] is self.model:
            with self.suspended():
                self.show_model(self.current_model)
        if not self._suspend:
            self._on_change(change)

    # -- what is shown -----------------------------------------------------------------
    def show_model(self, model) -> None:
        """Show the stage control of ``model``: a split, or ``layers_per_ipu``."""
        if not model.layered:
            self.splits = logic.contiguous_splits(model.blocks)
            if list(self.split.options) != list(self.splits):
                self.split.options = list(self.splits)
                self.split.value = next(iter(self.splits))
        else:
            self.layers_per_ipu.options = list(model.presets)
            if not self.layers_per_ipu.value:
                self.layers_per_ipu.value = _layers_text(model.default_layers)
        self.split.layout.display = "none" if model.layered else None
        self.layers_per_ipu.layout.display = None if model.layered else "none"

    def sync(self, config: Config) -> None:
        """Disable what does not apply to ``config``."""
        self.output_return_period.disabled = config.output_mode != "EveryN"
        self.schedule.disabled = config.sharded
