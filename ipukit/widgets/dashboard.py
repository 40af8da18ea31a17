"""The explorer's page: figures, text boxes and buttons, drawn with :mod:`ipukit.viz.plots`.

:class:`Dashboard` computes and starts nothing: the explorer wires its buttons.
"""
from __future__ import annotations

import json
from typing import Dict, List, Mapping, Optional, Sequence

from ..core.errors import needs_extra

with needs_extra("notebooks", "ipukit.widgets"):
    import ipywidgets as W
    import plotly.graph_objects as go

from ..timeline.costs import agreement
from ..viz import plots
from . import logic
from .comparison import ScheduleRow

FULL_WIDTH, PART_WIDTH = 1000, 500


def figure_output(figure: go.Figure) -> dict:
    """``figure`` as a notebook output: plotly's mime type, which JupyterLab's plotly renderer
    draws whole (an output carries the figure, not plotly's widget bundle)."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": json.loads(figure.to_json()),
                     "text/plain": f"<Figure: {figure.layout.title.text or 'plotly'}>"}}


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
        sizes = {"schedules": (340, full),
                 "modeled timeline": (300, full), "modeled utilisation": (320, part),
                 "memory": (360, part), "measured timeline": (300, full),
                 "measured utilisation": (320, part), "training": (320, part)}
        self._heights = {n: h for n, (h, _) in sizes.items()}
        #: every figure by name, as last drawn; each is the one output of its box, laid out
        #: at the box's width
        self.figures: Dict[str, go.Figure] = {}
        self._boxes = {n: W.Output(layout=W.Layout(width=f"{w}px", min_height=f"{h}px"))
                       for n, (h, w) in sizes.items()}
        self._modeled: Dict[str, go.Figure] = {}
        self._shown: tuple = (None, None, None)      # the modeled view, rows and title drawn
        box = self._boxes
        self.modeled_box = W.VBox([
            W.HTML("<h3>Modeled — updates as you move a control (no training)</h3>"),
            self.summary, box["schedules"], box["modeled timeline"],
            W.HBox([box["modeled utilisation"], box["memory"]])])
        self.measured_box = W.VBox([
            W.HTML("<h3>Measured — real training with ipukit</h3>"),
            W.HBox([self.run_button, self.stop_button, self.reset_button, self.calls]),
            self.status,
            W.HBox([box["measured utilisation"], box["training"]]),
            box["measured timeline"]])
        self.widget = W.VBox([controls, self.error, self.modeled_box, self.measured_box])
        self._draw({n: go.Figure(layout=dict(template="plotly_white")) for n in sizes}, {})
        self.clear_measured()

    def _draw(self, figures: Mapping[str, go.Figure], into: Dict[str, go.Figure]) -> None:
        for name, figure in figures.items():
            figure.update_layout(height=self._heights[name], width=None, autosize=True)
            into[name] = self.figures[name] = figure
            self._boxes[name].outputs = (figure_output(figure),)

    def show_modeled(self, view: logic.ModeledView, probe: Optional[logic.ProbeResult],
                     rows: Sequence[ScheduleRow] = ()) -> None:
        """Draw a modeled view and every schedule's ``rows``; ``probe`` (ipukit's verdict, None
        while unknown) adds the memory figure and the rejection note."""
        rejected = probe is not None and probe.error
        title = view.title + (" — PopTorch rejects this configuration" if rejected else "")
        if view.drawn_note:
            title += f" ({view.drawn_note})"
        # a verdict on the view already drawn redraws only what the verdict changes
        again = view is self._shown[0] and rows is self._shown[1]
        figures = {}
        if not again or title != self._shown[2]:
            figures["modeled timeline"] = plots.timeline_figure(view.drawn, title=title,
                                                                show_micro_batches=True)
        if not again:
            figures["modeled utilisation"] = plots.utilisation_figure(
                view.timeline, title="Utilisation per virtual IPU")
        if probe is not None and probe.report is not None:
            figures["memory"] = plots.memory_figure(probe.report)
        if rows and not again:
            figures["schedules"] = plots.schedule_comparison_figure(
                [r.to_dict() for r in rows], selected=view.config.schedule,
                title=f"Every schedule on these stages — modeled ({view.cost_source})")
        self._shown = (view, rows, title)
        self._draw(figures, self._modeled)
        self.summary.value = logic.format_summary(view)

    def show_measured(self, timeline, history: List[dict], call: int, modeled=None) -> None:
        """Draw the latest measured call (over ``modeled``, when given) and the training curves."""
        drawn, note = logic.clip_for_drawing(timeline)
        title = f"Latest call (call {call})" + (f" ({note})" if note else "")
        if modeled is None:
            figure = plots.timeline_figure(drawn, title=title)
        else:
            figure = plots.compare_figure(drawn, logic.clip_for_drawing(modeled)[0])
            figure.update_layout(title=dict(
                text=f"{title}: measured, and modeled from the calibrated costs<br><sup>"
                     f"{agreement(timeline, modeled)}</sup>"))
        self._draw({
            "measured utilisation": plots.utilisation_figure(
                timeline, title=f"Utilisation per virtual IPU (call {call})"),
            "training": plots.loss_accuracy_figure(history),
            "measured timeline": figure}, self._measured)

    def clear_measured(self) -> None:
        """Empty measured figures and training curves, as before any run."""
        self._measured = {}
        empty = {name: go.Figure(layout=dict(template="plotly_white",
                                              title=f"{name.capitalize()}: press Run to train"))
                 for name in ("measured utilisation", "measured timeline")}
        self._draw({**empty, "training": plots.loss_accuracy_figure([])}, self._measured)

    def show_error(self, message: Optional[str], failed: bool = False) -> None:
        """The error box: ipukit's verdict, or a run that failed."""
        self.error.value = logic.error_html(
            message, heading="The run failed:" if failed else "PopTorch would reject this:")

    def set_running(self, running: bool) -> None:
        self.run_button.disabled = self.reset_button.disabled = running
        self.stop_button.disabled = not running

    # the figures by their attribute names
    modeled_timeline_figure = property(lambda self: self.figures["modeled timeline"])
    modeled_utilisation_figure = property(lambda self: self.figures["modeled utilisation"])
    memory_figure = property(lambda self: self.figures["memory"])
    measured_timeline_figure = property(lambda self: self.figures["measured timeline"])
    measured_utilisation_figure = property(lambda self: self.figures["measured utilisation"])
    training_figure = property(lambda self: self.figures["training"])

    def redraw(self) -> None:
        """Send every figure to the front end again, whole."""
        for name, figure in self.figures.items():
            self._boxes[name].outputs = ()
            self._boxes[name].outputs = (figure_output(figure),)
