"""A per-device Gantt chart for schedules with several stages on one virtual IPU: each bar is
labelled ``stage:micro-batch`` and a device's second stage is hatched (its third dotted).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from .plots import timeline_figure

#: Hatching of a device's first, second, third ... stage (plotly pattern shapes).
STAGE_PATTERNS = ("", "/", ".", "x", "-", "|")


def device_stages(timeline) -> Dict[int, List[int]]:
    """The stages each virtual IPU ran in ``timeline``, in stage order."""
    held: Dict[int, set] = {}
    for e in timeline.device_events():
        held.setdefault(e.ipu, set()).add(e.stage)
    return {ipu: sorted(stages) for ipu, stages in sorted(held.items())}


def device_figure(timeline, title: Optional[str] = None):
    """One row per virtual IPU, each bar labelled ``stage:micro-batch``, a device's later
    stages hatched; otherwise :func:`~ipukit.viz.plots.timeline_figure`'s chart."""
    slot = {(ipu, s): i for ipu, stages in device_stages(timeline).items()
            for i, s in enumerate(stages)}
    ipu_of = {e.stage: e.ipu for e in timeline.device_events()}
    fig = timeline_figure(timeline, title=title, show_micro_batches=True)
    for trace in fig.data:
        if trace.customdata is None or trace.y is None or trace.y[0] == "host":
            continue
        stages = [int(c[0]) for c in trace.customdata]
        micro = [int(c[1]) for c in trace.customdata]
        trace.text = [f"{s}:{m}" if m >= 0 else f"{s}" for s, m in zip(stages, micro)]
        shapes = [STAGE_PATTERNS[slot.get((ipu_of.get(s, -1), s), 0) % len(STAGE_PATTERNS)]
                  for s in stages]
        trace.marker.pattern = dict(shape=shapes, fgcolor="white", fgopacity=0.6)
    layout = {ipu: ", ".join(str(s) for s in stages)
              for ipu, stages in device_stages(timeline).items()}
    note = " · ".join(f"IPU {ipu}: stages {s}" for ipu, s in layout.items())
    fig.update_layout(title_text=f"{fig.layout.title.text}<br><sup>{note}; "
                      "bars labelled stage:micro-batch, a device's second stage hatched</sup>")
    return fig
