"""Floor 3: figures and reports drawn from timelines (the ``viz`` extra: plotly, numpy).

:mod:`.plots` (plotly figures), :mod:`.profile` (profile folders), :mod:`.memory` (the
modeled memory report). Reads timelines and programs; nothing below imports it: a
timeline's figure is ``plots.timeline_figure(timeline)``.
"""
