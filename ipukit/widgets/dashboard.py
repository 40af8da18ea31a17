"""The explorer's page: its figures, text boxes and buttons, and how they are laid out.

:class:`Dashboard` owns every ``go.FigureWidget`` and HTML box and draws into
them what it is given — a modeled view, a measured call, an error — with
:mod:`ipukit.plots`. It computes nothing itself and starts nothing: the
buttons are wired by the explorer.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import ipywidgets as W
import plotly.graph_objects as go

from .. import plots
from . import logic

FULL_WIDTH, PART_WIDTH = 1000, 500


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


def _figure(height: int, width: int) -> go.FigureWidget:
    return go.FigureWidget(layout=dict(height=height, width=width, template="plotly_white"))


class Dashboard:
    """Figures, text and buttons of the explorer, laid out under its ``controls`` box."""

    def __init__(self, controls: W.Widget, calls: int) -> None:
        self.error = W.HTML(value="")
        self.summary = W.HTML(value="")
        self.status = W.HTML(value="Not run yet: press Run to train for real.")
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.reset_button = W.Button(description="New model", icon="refresh",
                                     tooltip="Start again from freshly initialised weights")
        self.calls = W.BoundedIntText(value=calls, min=1, max=100000, description="calls per run",
                                      style={"description_width": "150px"},
                                      layout=W.Layout(width="260px"))
        full, part = FULL_WIDTH, PART_WIDTH
        self.modeled_timeline_figure = _figure(300, full)
        self.modeled_utilisation_figure = _figure(320, part)
        self.memory_figure = _figure(360, part)
        self.measured_timeline_figure = _figure(300, full)
        self.measured_utilisation_figure = _figure(320, part)
        self.training_figure = _figure(320, part)
        self.figures: Dict[str, go.FigureWidget] = {
            "modeled timeline": self.modeled_timeline_figure,
            "modeled utilisation": self.modeled_utilisation_figure,
            "memory": self.memory_figure,
            "measured timeline": self.measured_timeline_figure,
            "measured utilisation": self.measured_utilisation_figure,
            "training": self.training_figure}
        self._measured: Dict[str, go.Figure] = {}
        self._modeled: Dict[str, go.Figure] = {}
        half = W.Layout(width=f"{part + 10}px")
        whole = W.Layout(width=f"{full + 10}px")
        self.modeled_box = W.VBox([
            W.HTML("<h3>Modeled — updates as you move a control (no training)</h3>"),
            self.summary, W.Box([self.modeled_timeline_figure], layout=whole),
            W.HBox([W.Box([self.modeled_utilisation_figure], layout=half),
                    W.Box([self.memory_figure], layout=half)])])
        self.measured_box = W.VBox([
            W.HTML("<h3>Measured — real training with ipukit</h3>"),
            W.HBox([self.run_button, self.stop_button, self.reset_button, self.calls]),
            self.status,
            W.HBox([W.Box([self.measured_utilisation_figure], layout=half),
                    W.Box([self.training_figure], layout=half)]),
            W.Box([self.measured_timeline_figure], layout=whole)])
        self.widget = W.VBox([controls, self.error, self.modeled_box, self.measured_box])
        self.clear_measured()

    # -- drawing -----------------------------------------------------------------------
    def _draw(self, figures: Mapping[str, go.Figure], into: Dict[str, go.Figure]) -> None:
        for name, figure in figures.items():
            into[name] = figure
            update_figure(self.figures[name], figure)

    def show_modeled(self, view: logic.ModeledView, probe: Optional[logic.ProbeResult]) -> None:
        """Draw a modeled view; ``probe`` (ipukit's verdict) adds the memory figure and the
        rejection note (None: not known yet)."""
        rejected = probe is not None and probe.error
        title = view.title + (" — PopTorch rejects this configuration" if rejected else "")
        if view.drawn_note:
            title += f" ({view.drawn_note})"
        figures = {
            "modeled timeline": plots.timeline_figure(view.drawn, title=title,
                                                      show_micro_batches=True),
            "modeled utilisation": plots.utilisation_figure(
                view.timeline, title="Utilisation per virtual IPU")}
        if probe is not None and probe.report is not None:
            figures["memory"] = plots.memory_figure(probe.report)
        self._draw(figures, self._modeled)
        self.summary.value = logic.format_summary(view)

    def show_measured(self, timeline, history: List[dict], call: int) -> None:
        """Draw the latest measured call and the training curves."""
        drawn, note = logic.clip_for_drawing(timeline)
        title = f"Latest call (call {call})" + (f" ({note})" if note else "")
        self._draw({
            "measured utilisation": plots.utilisation_figure(
                timeline, title=f"Utilisation per virtual IPU (call {call})"),
            "training": plots.loss_accuracy_figure(history),
            "measured timeline": plots.timeline_figure(drawn, title=title)}, self._measured)

    def clear_measured(self) -> None:
        """Empty training curves, before any run (or after a new model)."""
        self._measured = {}
        self._draw({"training": plots.loss_accuracy_figure([])}, self._measured)

    def show_error(self, message: Optional[str], failed: bool = False) -> None:
        """The error box: ipukit's verdict, or a run that failed."""
        heading = "The run failed:" if failed else "PopTorch would reject this:"
        self.error.value = logic.error_html(message, heading=heading)

    def set_running(self, running: bool) -> None:
        self.run_button.disabled = running
        self.reset_button.disabled = running
        self.stop_button.disabled = not running

    def redraw(self) -> None:
        """Send every figure to the front end again (a view still being created can miss
        updates)."""
        for figures in (self._modeled, self._measured):
            for name, figure in figures.items():
                update_figure(self.figures[name], figure)
