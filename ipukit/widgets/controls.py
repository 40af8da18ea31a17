"""The explorer's controls: the widgets a reader moves, and the :class:`Config` they describe.

:class:`Controls` shows the stage control that fits the chosen model (a stage split for
the convnet, an IPUConfig's ``layers_per_ipu`` for the ViT) and turns the values into a
:class:`~ipukit.widgets.logic.Config`; it knows nothing of figures or training.
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
    return W.Layout(width="420px")     # one per control: a shared one hides them all at once


def _layers_text(layers) -> str:
    return ", ".join(str(n) for n in layers)


class Controls:
    """Every control of the explorer, as attributes named like :class:`Config`'s fields.

    ``models`` maps a name to a model spec; ``config`` holds the starting values;
    ``on_change(change)`` is called after every change (not inside :meth:`suspended`).
    """

    def __init__(self, models: Dict[str, Any], config: Config,
                 on_change: Callable) -> None:
        self.models = models
        self.learning_rate = config.learning_rate
        self.splits = logic.contiguous_splits(config.blocks)

        def slider(name, maximum, description):
            return W.IntSlider(value=getattr(config, name), min=1, max=maximum,
                               description=description, layout=_wide(), continuous_update=False,
                               style=_STYLE)

        def dropdown(options, value, description, **kw):
            return W.Dropdown(options=list(options), value=value, description=description,
                              style=_STYLE, layout=_wide(), **kw)

        self.model = dropdown(models, config.model, "model", disabled=len(models) < 2)
        self.device_iterations = slider("device_iterations", 64, "device iterations")
        self.gradient_accumulation = slider("gradient_accumulation", 64, "gradient accumulation")
        self.micro_batch_size = slider("micro_batch_size", 128, "micro-batch size")
        self.split = dropdown(self.splits, config.split, "stage split")
        model = models[config.model]
        self.layers_per_ipu = W.Combobox(
            value=_layers_text(config.layers_per_ipu or model.default_layers),
            options=list(model.presets), ensure_option=False, continuous_update=False,
            description="layers per IPU", placeholder="e.g. 2, 2, 2, 2 (-1: share the rest)",
            style=_STYLE, layout=_wide())
        self.execution = W.ToggleButtons(options=list(logic.EXECUTIONS),
                                         value="sharded" if config.sharded else "pipelined",
                                         description="execution", style=_STYLE)
        self.schedule = dropdown(logic.SCHEDULES, config.schedule, "schedule")
        self.output_mode = dropdown(logic.OUTPUT_MODES, config.output_mode, "output mode")
        self.output_return_period = slider("output_return_period", 16, "EveryN period")
        self.offload = W.Checkbox(value=config.offload_optimizer,
                                  description="offload optimiser state", indent=False)
        left = [self.model, self.device_iterations, self.gradient_accumulation,
                self.micro_batch_size, self.split, self.layers_per_ipu, self.output_mode,
                self.output_return_period]
        self.widgets: List[W.Widget] = left[:6] + [self.execution, self.schedule] + left[6:] + [
            self.offload]
        self._suspend = False
        self._on_change = on_change
        for w in self.widgets:
            w.observe(self._changed, names="value")
        self.box = W.HBox([W.VBox(left), W.VBox([self.execution, self.schedule, self.offload])])
        self.show_model(model)

    @property
    def current_model(self):
        return self.models[self.model.value]

    @property
    def config(self) -> Config:
        """The :class:`Config` the controls describe: :class:`ipukit.Error` for a
        ``layers_per_ipu`` that does not parse or fit, a ``ValueError`` for stages the schedule
        cannot place (:func:`~ipukit.widgets.logic.placed`)."""
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
