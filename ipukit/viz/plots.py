"""PopVision-style plotly figures of timelines, utilisation, memory and training curves.

Every figure is built from plain numbers, so measured and modeled runs are drawn by the same
code, with ``go.Bar``/``go.Scatter`` on a numeric time axis (ms): cheap to rebuild, and
unchanged inside a ``go.FigureWidget``.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..core.errors import needs_extra

with needs_extra("viz", "ipukit.viz.plots"):
    import numpy as np
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

from ..schedules.registry import title_of
from ..timeline.costs import agreement
from ..timeline.events import COMPUTE_KINDS, Timeline

# PopVision's convention: forward passes green, backward passes red.
COLOURS = {"forward": "#3a9a4b", "backward": "#d9463e", "input-grad": "#f08a24",
           "weight-grad": "#7b4fa8", "step": "#8a8a8a", "host": "#7b93b0", "transfer": "#b8c4d3"}
KIND_ORDER = ("forward", "backward", "input-grad", "weight-grad", "step", "transfer", "host")
LABELS = {"forward": "forward", "backward": "backward", "step": "optimiser step (host)",
          "transfer": "host ↔ device transfer", "host": "host",
          "input-grad": "input gradient (I)", "weight-grad": "weight gradient (W)"}
#: The parts of :meth:`Timeline.idle_breakdown`, in drawing order, with their colours.
BREAKDOWN_PARTS = (
    ("busy", "busy (forward, backward)", "#3a9a4b"),
    ("bubble", "bubble: fill and drain", "#c9c9c9"),
    ("imbalance", "imbalance, hand-offs, core waits", "#f0b35b"),
    ("host", "host work", "#7b93b0"),
    ("step", "optimiser step (host)", "#8a8a8a"),
)
IDLE_COLOUR = "rgba(150, 150, 150, 0.18)"
MEMORY_PARTS = (
    ("parameter_bytes", "parameters", "#4c72b0"),
    ("gradient_accumulator_bytes", "gradient accumulators", "#dd8452"),
    ("optimizer_state_on_chip_bytes", "optimiser state", "#8172b3"),
    ("activation_stash_bytes", "activation stash", "#55a868"),
    ("optimizer_state_host_bytes", "optimiser state (host memory)", "#c8c0e0"),
)
_FONT = dict(family="Inter, Helvetica, Arial, sans-serif", size=12)


# -- timelines -----------------------------------------------------------------------------

def _track_name(ipu: int, replica: int) -> str:
    if ipu < 0:
        return "host"
    return f"IPU {ipu}" if replica == 0 else f"IPU {ipu} · replica {replica}"


def track_order(timeline: Timeline) -> List[str]:
    """Row names of the Gantt chart, top to bottom: IPU 0, its replicas, ..., host (and steps)."""
    keys = {(e.ipu, e.replica) if e.kind != "step" else (-1, 0) for e in timeline.events}
    keys |= {(e.ipu, e.replica) for e in timeline.device_events()}
    order = sorted(keys, key=lambda k: (k[0] < 0, k[0], k[1]))
    return list(dict.fromkeys(_track_name(ipu, replica) for ipu, replica in order))


def _timeline_traces(timeline: Timeline, show_micro_batches: bool = True,
                     legend: bool = True, group: str = "") -> List[go.Bar]:
    """One horizontal bar trace per kind of work, bars from ``base`` (ms)."""
    t0 = timeline.start
    by_kind: Dict[str, List] = {}
    for e in timeline.events:
        if e.kind != "step":
            by_kind.setdefault(e.kind, []).append(e)
    if timeline.host_steps():
        by_kind["step"] = timeline.host_steps()
    kinds = [k for k in KIND_ORDER if k in by_kind] + sorted(set(by_kind) - set(KIND_ORDER))
    traces = []
    for kind in kinds:
        events = by_kind[kind]
        cols = np.array([(e.start, e.end, e.stage, e.micro_batch, e.iteration, e.call)
                         for e in events], dtype=float)
        base = (cols[:, 0] - t0) * 1e3
        width = (cols[:, 1] - cols[:, 0]) * 1e3
        custom = np.column_stack([cols[:, 2:], base + width])
        what = LABELS.get(kind, kind)
        mb = " · micro-batch %{customdata[1]}" if kind in ("forward", "backward") else ""
        bar = dict(
            name=what, orientation="h", base=base, x=width,
            y=np.array([_track_name(e.ipu, e.replica) for e in events]),
            marker=dict(color=COLOURS.get(kind, "#999999"), line=dict(width=0.5, color="white")),
            customdata=custom, legendgroup=kind + group, showlegend=legend,
            hovertemplate=(f"{what}{mb}<br>stage %{{customdata[0]}} · %{{y}}"
                           "<br>iteration %{customdata[2]} · call %{customdata[3]}"
                           "<br>%{base:.3f} → %{customdata[4]:.3f} ms (%{x:.3f} ms)"
                           "<extra></extra>"),
        )
        if show_micro_batches:
            labels = np.where(cols[:, 3] < 0, "", cols[:, 3].astype(int).astype(str))
            bar.update(text=labels, textposition="inside", insidetextanchor="middle",
                       textfont=dict(color="white", size=11), cliponaxis=True)
        traces.append(go.Bar(**bar))
    return traces


def schedule_name(kind) -> str:
    """Schedule names as the options spell them: ``1F1B``, ``GPipe``."""
    return title_of(kind)


def _describe(timeline: Timeline) -> str:
    meta = timeline.meta
    kind = meta.get("kind") or meta.get("schedule")
    parts = [schedule_name(kind)] if kind else []
    parts += [f"{meta[k]} {w}" for k, w in (("num_stages", "stages"),
                                            ("micro_batches", "micro-batches")) if meta.get(k)]
    if timeline.events:
        parts.append(f"{timeline.time_per_call() * 1e3:.2f} ms per call")
        if timeline.iterations > 1:
            per = "step" if timeline.meta.get("training", True) else "device iteration"
            parts.append(f"{timeline.time_per_step() * 1e3:.2f} ms per {per}")
        if timeline.meta.get("samples"):
            parts.append(f"{timeline.throughput():,.0f} samples/s")
        parts.append(f"utilisation {timeline.utilisation()['overall']:.0%}")
    return " · ".join(parts)


def _legend_once(fig: go.Figure) -> go.Figure:
    """One legend entry per kind drawn in any panel."""
    seen = set()
    for trace in fig.data:
        if trace.showlegend is not False:
            trace.showlegend = (trace.legendgroup or trace.name) not in seen
            seen.add(trace.legendgroup or trace.name)
    return fig


def _gantt_axes(fig: go.Figure, rows: Sequence[str], row: Optional[int] = None) -> None:
    kw = dict(row=row, col=1) if row is not None else {}
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=list(rows),
                     autorange="reversed", showgrid=False, **kw)
    fig.update_xaxes(title_text="time (ms)", rangemode="tozero", zeroline=False, **kw)


def timeline_figure(timeline: Timeline, title: Optional[str] = None,
                    show_micro_batches: bool = True) -> go.Figure:
    """A PopVision-style Gantt chart: one row per virtual IPU (and the host), time in ms.

    Forward green, backward red, optimiser steps grey on the host row (ipukit
    steps every stage in one host operation); micro-batch numbers on the bars
    (``show_micro_batches``); bubbles are the gaps. The title says ``measured``
    or ``modeled``.
    """
    rows = track_order(timeline)
    detail = _describe(timeline)
    fig = go.Figure(data=_timeline_traces(timeline, show_micro_batches))
    fig.update_layout(
        title=dict(text=f"{title or 'Pipeline timeline'} — {timeline.label}"
                   + (f"<br><sup>{detail}</sup>" if detail else "")),
        barmode="overlay", bargap=0.25, font=_FONT, template="plotly_white",
        height=max(220, 70 + 46 * len(rows)), margin=dict(l=10, r=10, t=70, b=40),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
        uniformtext=dict(minsize=8, mode="hide"),
    )
    _gantt_axes(fig, rows)
    return fig


def compare_figure(measured: Timeline, modeled: Timeline) -> go.Figure:
    """Two timelines stacked on a shared time axis, each titled with its label."""
    rows = [track_order(measured), track_order(modeled)]
    titles = [tl.label + (f" — {_describe(tl)}" if _describe(tl) else "")
              for tl in (measured, modeled)]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=titles, row_heights=[len(rows[0]) or 1, len(rows[1]) or 1])
    for i, tl in enumerate((measured, modeled), start=1):
        for trace in _timeline_traces(tl):
            fig.add_trace(trace, row=i, col=1)
        _gantt_axes(fig, rows[i - 1], row=i)
    fig.update_xaxes(title_text="", row=1, col=1)
    notes = list(modeled.meta.get("notes") or ())
    if notes:   # what the model leaves out for this call (e.g. interpreter-lock contention)
        fig.add_annotation(text="Model: " + "<br>".join(notes), xref="paper", yref="paper",
                           x=0.0, y=-0.06, xanchor="left", yanchor="top", showarrow=False,
                           align="left", font=dict(size=10, color="#555"))
    fig.update_layout(title=dict(text="Measured vs modeled<br><sup>"
                                 + agreement(measured, modeled) + "</sup>"),
                      barmode="overlay", bargap=0.25, font=_FONT, template="plotly_white",
                      height=max(320, 140 + 40 * (len(rows[0]) + len(rows[1]))) + 30 * len(notes),
                      margin=dict(l=10, r=10, t=80, b=40 + 30 * len(notes)),
                      uniformtext=dict(minsize=8, mode="hide"),
                      legend=dict(orientation="h", yanchor="bottom", y=1.04, xanchor="right", x=1.0))
    return _legend_once(fig)


# -- utilisation ---------------------------------------------------------------------------

def _utilisation_of(source: Union[Timeline, Mapping[str, Any]]
                    ) -> Tuple[Dict[Any, float], Optional[float]]:
    if isinstance(source, Timeline):
        source = source.utilisation()
    if "per_ipu" in source:
        return dict(source["per_ipu"]), source.get("overall")
    per_ipu = {k: float(v) for k, v in source.items()}    # a bare {ipu: fraction}
    overall = sum(per_ipu.values()) / len(per_ipu) if per_ipu else None
    return per_ipu, overall


def utilisation_figure(timeline_or_utilisation_dict: Union[Timeline, Mapping[str, Any]],
                       title: Optional[str] = None) -> go.Figure:
    """Busy share of each virtual IPU in %, with the overall value in the title and as a line.

    Accepts a :class:`~ipukit.Timeline` (the subtitle then starts with its speed),
    the dict of :meth:`Timeline.utilisation`, or a bare ``{ipu: fraction}``.
    """
    source = timeline_or_utilisation_dict
    per_ipu, overall = _utilisation_of(source)
    names = [f"IPU {k}" if isinstance(k, int) else str(k) for k in per_ipu]
    values = [100.0 * v for v in per_ipu.values()]
    label = speed = ""
    if isinstance(source, Timeline):
        label = f" — {source.label}"
        if source.events:
            per = "step" if source.meta.get("training", True) else "device iteration"
            speed = f"{source.time_per_step() * 1e3:.2f} ms per {per} · "
            if source.meta.get("samples"):
                speed += f"{source.throughput():,.0f} samples/s · "
    heading = (title or "Utilisation per virtual IPU") + label
    if overall is not None:
        heading += (f"<br><sup>{speed}overall {100 * overall:.1f}% busy · "
                    f"idle {100 * (1 - overall):.1f}%</sup>")
    fig = go.Figure(go.Bar(x=names, y=values, text=[f"{v:.0f}%" for v in values],
                           textposition="outside", marker_color="#3a9a4b", name="utilisation",
                           hovertemplate="%{x}: %{y:.1f}%<extra></extra>"))
    if overall is not None and names:
        fig.add_hline(y=100 * overall, line=dict(dash="dash", color="#555555", width=1),
                      annotation_text=f"overall {100 * overall:.1f}%",
                      annotation_position="top left")
    fig.update_layout(title=dict(text=heading), font=_FONT, template="plotly_white",
                      height=320, margin=dict(l=10, r=10, t=70, b=40), showlegend=False)
    fig.update_yaxes(title_text="busy (%)", range=[0, 105], ticksuffix="%")
    fig.update_xaxes(type="category")
    return fig


# -- memory --------------------------------------------------------------------------------

def _unit(max_bytes: float) -> Tuple[str, float]:
    for name, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if max_bytes >= size:
            return name, float(size)
    return "bytes", 1.0


def memory_figure(report) -> go.Figure:
    """Stacked bars per stage: parameters, gradient accumulators, optimiser state, activations.

    Optimiser state in host memory (``TensorLocations`` off chip) is hatched, on
    top. ``report`` is a :class:`~ipukit.viz.memory.MemoryReport` or its ``to_dict()``.
    """
    data = report.to_dict() if hasattr(report, "to_dict") else dict(report)
    stages = data.get("stages", [])
    names = [f"stage {st['stage']} · IPU {st['ipu']}" for st in stages]
    totals = [sum(st.get(key, 0) or 0 for key, _, _ in MEMORY_PARTS) for st in stages]
    unit, size = _unit(max(totals, default=0))
    fig = go.Figure()
    for key, label, colour in MEMORY_PARTS:
        values = [(st.get(key, 0) or 0) / size for st in stages]
        if not any(values) and key in ("optimizer_state_host_bytes", "gradient_accumulator_bytes",
                                       "optimizer_state_on_chip_bytes"):
            continue
        bar = dict(x=names, y=values, name=label, marker_color=colour,
                   hovertemplate=f"%{{x}}<br>{label}: %{{y:.3f}} {unit}<extra></extra>")
        if key == "optimizer_state_host_bytes":
            bar["marker_pattern_shape"] = "/"
        fig.add_trace(go.Bar(**bar))
    kind = schedule_name(data.get("schedule_kind", ""))
    stash = [st.get("micro_batches_in_flight", 0) for st in stages]
    sub = (f"{kind} · {data.get('micro_batches', '')} micro-batches · activations of "
           f"{stash} micro-batches held per stage")
    fig.update_layout(barmode="stack", font=_FONT, template="plotly_white", height=360,
                      title=dict(text=f"Memory per stage<br><sup>{sub}</sup>"),
                      margin=dict(l=10, r=10, t=70, b=80),   # the legend below the ticks
                      legend=dict(orientation="h", yref="container", yanchor="bottom", y=0))
    fig.update_yaxes(title_text=unit, rangemode="tozero")
    fig.update_xaxes(type="category")
    return fig


def memory_timeline_figure(timeline: Timeline, title: Optional[str] = None) -> go.Figure:
    """The Gantt chart with each virtual IPU's measured memory (``Timeline.memory``) under it.

    One line of bytes alive per IPU, the peak marked; without tracked memory, the schedule alone.
    """
    rows = track_order(timeline)
    tracks = [m for m in timeline.memory if m.samples]
    if not tracks:
        return timeline_figure(timeline, title=title)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[max(1, len(rows)), 2],
                        subplot_titles=("schedule", "memory alive per virtual IPU (measured)"))
    for trace in _timeline_traces(timeline):
        fig.add_trace(trace, row=1, col=1)
    _gantt_axes(fig, rows, row=1)
    unit, size = _unit(max(m.peak for m in tracks))
    t0 = timeline.start
    palette = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3")
    for i, m in enumerate(tracks):
        colour = palette[i % len(palette)]
        fig.add_trace(go.Scatter(
            x=[(t - t0) * 1e3 for t, _ in m.samples], y=[b / size for _, b in m.samples],
            mode="lines", line=dict(shape="hv", color=colour, width=1.5), name=f"{m.name} memory",
            hovertemplate=f"{m.name}<br>%{{x:.3f}} ms<br>%{{y:.3f}} {unit}<extra></extra>"),
            row=2, col=1)
        fig.add_trace(go.Scatter(
            x=[(m.peak_time - t0) * 1e3], y=[m.peak / size], mode="markers", showlegend=False,
            marker=dict(color=colour, size=7, symbol="triangle-down"),
            hovertemplate=f"{m.name} peak: %{{y:.3f}} {unit}<extra></extra>"), row=2, col=1)
    fig.update_yaxes(title_text=unit, rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="", row=1, col=1)
    fig.update_xaxes(title_text="time (ms)", row=2, col=1)
    fig.update_layout(title=dict(text=f"{title or 'Pipeline timeline and memory'} — "
                                 f"{timeline.label}"),
                      barmode="overlay", bargap=0.25, font=_FONT, template="plotly_white",
                      height=max(380, 260 + 46 * len(rows)), margin=dict(l=10, r=10, t=80, b=40),
                      legend=dict(orientation="h", yanchor="bottom", y=1.04, xanchor="right", x=1.0),
                      uniformtext=dict(minsize=8, mode="hide"))
    return fig


# -- training curves -----------------------------------------------------------------------

def loss_accuracy_figure(history: Iterable[Mapping[str, Any]]) -> go.Figure:
    """Loss (left axis) and accuracy in % (right axis) against the step.

    ``history``: dicts with ``step``, ``loss``, ``accuracy`` (None skipped). Accuracy
    is a percentage, or a fraction when every value is at most 1.
    """
    rows = list(history)
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    series = {key: [(s, float(r[key])) for s, r in zip(steps, rows) if r.get(key) is not None]
              for key in ("loss", "accuracy")}
    if series["accuracy"] and max(v for _, v in series["accuracy"]) <= 1.0:
        series["accuracy"] = [(s, 100.0 * v) for s, v in series["accuracy"]]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for key, colour, secondary in (("loss", "#d9463e", False), ("accuracy", "#3a9a4b", True)):
        points = series[key]
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points],
                                 mode="lines+markers" if len(points) < 60 else "lines",
                                 name=key if key == "loss" else "accuracy (%)",
                                 line=dict(color=colour)), secondary_y=secondary)
    fig.update_layout(title=dict(text="Training"), font=_FONT, template="plotly_white", height=320,
                      margin=dict(l=10, r=10, t=60, b=40),
                      legend=dict(orientation="h", yanchor="bottom", y=1.06, xanchor="right", x=1.0))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="accuracy (%)", range=[0, 100], tickmode="array",
                     tickvals=[0, 25, 50, 75, 100], showgrid=False, secondary_y=True)
    return fig


# -- where the time goes -----------------------------------------------------------------

def breakdown_figure(runs: Mapping[str, Timeline], title: Optional[str] = None) -> go.Figure:
    """One stacked bar per run: busy, bubble, imbalance, host and step as % of its IPU time.

    Each run's label carries its speed (ms per step, samples/s when known); the
    bars explain it (:meth:`Timeline.idle_breakdown`). The hover gives the
    textbook bubble (N − 1)/(M + N − 1).
    """
    names = [f"{name}<br>{tl.time_per_step() * 1e3:.1f} ms/step"
             + (f" · {tl.throughput():,.0f} samples/s" if tl.meta.get("samples") else "")
             for name, tl in runs.items()]
    rows = [tl.idle_breakdown() for tl in runs.values()]
    fig = go.Figure()
    for key, label, colour in BREAKDOWN_PARTS:
        values = [100.0 * r["shares"][key] for r in rows]
        fig.add_trace(go.Bar(
            y=names, x=values, name=label, orientation="h", marker_color=colour,
            text=[f"{v:.0f}%" if v >= 4 else "" for v in values], textposition="inside",
            customdata=[100.0 * r["textbook_bubble"] for r in rows],
            hovertemplate=(f"{label}: %{{x:.1f}}% of IPU time"
                           + ("<br>textbook (N−1)/(M+N−1): %{customdata:.1f}%"
                              if key == "bubble" else "") + "<extra></extra>")))
    fig.update_layout(barmode="stack", font=_FONT, template="plotly_white",
                      title=dict(text=title or "Where the virtual IPUs' time goes"),
                      height=max(260, 150 + 60 * len(names)), margin=dict(l=10, r=10, t=90, b=40),
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
    fig.update_xaxes(title_text="% of wall time × virtual IPUs", range=[0, 100.5], ticksuffix="%")
    fig.update_yaxes(type="category", autorange="reversed")
    return fig


def _idle_spans(timeline: Timeline) -> List[Tuple[str, float, float]]:
    """(row, start, end) of every stretch a virtual IPU computes nothing."""
    t0, t1 = timeline.start, timeline.end
    busy: Dict[str, List[Tuple[float, float]]] = {}
    for e in timeline.device_events():
        if e.kind in COMPUTE_KINDS:
            busy.setdefault(_track_name(e.ipu, e.replica), []).append((e.start, e.end))
    spans = []
    for row, intervals in busy.items():
        t = t0
        for a, b in sorted(intervals):
            if a > t + 1e-12:
                spans.append((row, t, a))
            t = max(t, b)
        if t1 > t + 1e-12:
            spans.append((row, t, t1))
    return spans


def _unit_costs(forward_cost: float, backward_cost: float, kinds: Sequence[str]) -> str:
    from ..schedules.generators import SPLIT_BACKWARD

    split = bool(set(kinds) & set(SPLIT_BACKWARD))
    if forward_cost == backward_cost == 1.0 and not split:
        return "each pass takes one unit"
    return (f"a forward takes {forward_cost:g} unit, a backward {backward_cost:g}"
            + (f" (split: I and W {backward_cost / 2:g} each)" if split else ""))


def schedule_grid_figure(num_stages: int = 4, micro_batches: int = 8,
                         kinds: Sequence[str] = ("gpipe", "1f1b"),
                         forward_cost: float = 1.0, backward_cost: float = 1.0) -> go.Figure:
    """The idealised schedules side by side: unit-cost passes, the bubble shaded.

    One panel per kind, time in units of one pass, micro-batches numbered, idle
    cells shaded (the bubble: (N − 1)/(M + N − 1) of each row for GPipe and
    1F1B); each row names its stage's activation stash at most (GPipe M, 1F1B N − s).
    """
    from ..timeline.simulate import simulate

    timelines = [simulate(k, num_stages, micro_batches, forward_cost=forward_cost,
                          backward_cost=backward_cost) for k in kinds]
    titles = []
    for k, tl in zip(kinds, timelines):
        b = tl.idle_breakdown()
        formula = ("(N−1)/N" if k.startswith("sharded") else
                   "(N−1)/(M+N−1)" if k in ("gpipe", "1f1b") else "")
        titles.append(f"{schedule_name(k)}: {tl.wall_time:g} units, idle "
                      f"{100 * b['shares']['bubble']:.0f}%" + (f" = {formula}" if formula else ""))
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=titles, horizontal_spacing=0.12)
    for col, (k, tl) in enumerate(zip(kinds, timelines), start=1):
        peak = tl.peak_in_flight()
        rename = {f"IPU {s}": f"stage {s} · holds {peak.get(s, 0)}" for s in range(num_stages)}
        idle = _idle_spans(tl)
        fig.add_trace(go.Bar(
            name="idle (bubble)", orientation="h", base=[a for _, a, _ in idle],
            x=[b - a for _, a, b in idle], y=[rename[r] for r, _, _ in idle],
            marker=dict(color=IDLE_COLOUR, pattern=dict(shape="/", fgcolor="#aaaaaa"),
                        line=dict(width=0)),
            legendgroup="idle", showlegend=(col == 1),
            hovertemplate="idle %{base} → %{x} units<extra></extra>"), row=1, col=col)
        for trace in _timeline_traces(tl):
            if trace.name == LABELS["step"]:
                continue                    # an idealised grid has no optimiser step
            trace.y = [rename.get(y, y) for y in trace.y]
            trace.base = [b / 1e3 for b in trace.base]     # units, not ms
            trace.x = [w / 1e3 for w in trace.x]
            trace.hovertemplate = ("%{fullData.name} · micro-batch %{customdata[1]}"
                                   "<br>%{y}<extra></extra>")
            fig.add_trace(trace, row=1, col=col)
        fig.update_yaxes(type="category", categoryarray=[rename[f"IPU {s}"]
                                                         for s in range(num_stages)],
                         categoryorder="array", autorange="reversed", row=1, col=col)
        fig.update_xaxes(title_text="time (units of one pass)", dtick=2, row=1, col=col)
    fig.update_layout(
        title=dict(text=f"Idealised schedules: {num_stages} stages, {micro_batches} micro-batches"
                        f"<br><sup>{_unit_costs(forward_cost, backward_cost, kinds)}; "
                        f"shaded cells are idle; "
                        f"'holds k': activations of k micro-batches stashed at most</sup>"),
        barmode="overlay", bargap=0.2, font=_FONT, template="plotly_white",
        height=max(300, 160 + 44 * num_stages), margin=dict(l=10, r=10, t=90, b=80),
        uniformtext=dict(minsize=8, mode="hide"),   # the legend below the ticks and axis title
        legend=dict(orientation="h", yref="container", yanchor="bottom", y=0))
    return _legend_once(fig)


# -- schedules side by side ------------------------------------------------------------------

#: The comparison's panels: (row key, title, scale, format of a bar's label).
SCHEDULE_PANELS = (
    ("time_per_step", "time per optimiser step (ms)", 1e3, "{:.1f}"),
    ("bubble", "bubble: fill and drain (% of IPU time)", 100.0, "{:.0f}%"),
    ("peak_activations", "peak activations on one IPU (stage × micro-batch)", 1.0, "{:g}"),
)
SELECTED_COLOUR, OTHER_COLOUR = "#2f6db5", "#a9c4e4"


def schedule_comparison_figure(rows: Sequence[Mapping[str, Any]], selected: Optional[str] = None,
                               title: Optional[str] = None) -> go.Figure:
    """Every schedule side by side: time per optimiser step, bubble and peak activations.

    ``rows``: dicts with ``schedule``, ``ipus``, ``available``, ``reason``,
    ``time_per_step`` (s), ``bubble`` (share), ``peak_activations`` (stage ×
    micro-batch units), e.g. from :func:`ipukit.widgets.comparison.schedule_rows`.
    A schedule that cannot run has no bar (the hover says why); ``selected`` is
    darker; one bar trace per panel, named by its title. On mixed IPU counts the
    title says so and the hover gives IPU-time per step.
    """
    names = [f"{r['schedule']}<br>{r['ipus']} IPUs" if r.get("available", True)
             else f"{r['schedule']}<br>—" for r in rows]
    fig = make_subplots(rows=1, cols=len(SCHEDULE_PANELS), horizontal_spacing=0.07,
                        subplot_titles=[p[1] for p in SCHEDULE_PANELS])
    colours = [SELECTED_COLOUR if r["schedule"] == selected else OTHER_COLOUR for r in rows]
    mixed = len({r.get("ipus") for r in rows if r.get("available", True)}) > 1
    for col, (key, label, scale, fmt) in enumerate(SCHEDULE_PANELS, start=1):
        values = [None if not r.get("available", True) or r.get(key) is None
                  else scale * r[key] for r in rows]
        notes = [r.get("reason") or "" for r in rows]
        if mixed:
            notes = [n or (f"IPU-time per step: {1e3 * r['time_per_step'] * r['ipus']:.1f} "
                           f"IPU·ms" if r.get("time_per_step") is not None and r.get("ipus")
                           else "") for n, r in zip(notes, rows)]
        fig.add_trace(go.Bar(
            x=names, y=values, name=label, marker_color=colours, showlegend=False,
            text=["" if v is None else fmt.format(v) for v in values], textposition="outside",
            customdata=notes, cliponaxis=False,
            hovertemplate="%{x}: %{y:.3g}<br>%{customdata}<extra>" + label + "</extra>"),
            row=1, col=col)
        top = max([v for v in values if v is not None], default=1.0)
        fig.update_yaxes(range=[0, 1.18 * top if top > 0 else 1.0], row=1, col=col)
        fig.update_xaxes(type="category", tickfont=dict(size=10), row=1, col=col)
    fig.update_layout(
        title=dict(text=(title or "Every schedule on these stages — modeled")
                   + ("<br><sup>bars on different numbers of IPUs: compare IPU-time per step "
                      "(hover)</sup>" if mixed else "")),
        font=_FONT, template="plotly_white", height=340, margin=dict(l=10, r=10, t=80, b=60),
        showlegend=False)
    for annotation in fig.layout.annotations:        # the panel titles, a little smaller
        annotation.font = dict(size=12)
    return fig

