"""Profile files of a call (``Options().profileDir(path)``, after every call): a Chrome trace
for Perfetto or ``chrome://tracing``, and a self-contained HTML report that opens offline.
"""
from __future__ import annotations

import html
import json
import os
import threading
import weakref
from typing import Any, Dict

from ..core.errors import MissingExtraError
from ..schedules.registry import title_of as schedule_name
from ..timeline.events import Timeline

_lock = threading.Lock()
_models: Dict[tuple, Dict[int, "weakref.ref"]] = {}   # (folder, kind) -> {number: model}


def _model_number(directory: str, kind: str, model) -> int:
    """0 for the first model of a kind writing to ``directory``, then 1, 2, ..."""
    if model is None:
        return 0
    with _lock:
        numbers = _models.setdefault((directory, kind), {})
        for number, ref in numbers.items():
            if ref() is model:
                return number
        number = len(numbers)
        numbers[number] = weakref.ref(model)
        return number


def profile_stem(timeline: Timeline, directory: str, model=None) -> str:
    """``training-call0003`` (or ``training1-call0003`` for a second training model)."""
    meta = timeline.meta
    kind = str(meta.get("model") or ("modeled" if timeline.modeled else "timeline"))
    kind = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in kind)
    call = int(meta.get("call", 0) or 0)
    number = _model_number(os.path.abspath(directory), kind, model)
    return f"{kind}{number if number else ''}-call{call:04d}"


def _summary(timeline: Timeline) -> Dict[str, Any]:
    meta = timeline.meta
    u = timeline.utilisation()
    rows = {
        "timeline": timeline.label,
        "model": meta.get("model", ""),
        "call": meta.get("call", ""),
        "schedule": schedule_name(meta.get("kind") or meta.get("schedule", "")),
        "stages": meta.get("num_stages", ""),
        "micro-batches per iteration": meta.get("micro_batches", ""),
        "iterations": meta.get("iterations", ""),
        "replicas": meta.get("replicas", ""),
        "wall time": f"{timeline.wall_time * 1e3:.3f} ms",
    }
    if timeline.throughput() > 0:
        rows["throughput"] = f"{timeline.throughput():.1f} samples/s"
    rows["time per step"] = f"{timeline.time_per_step() * 1e3:.3f} ms"
    b = timeline.idle_breakdown()["shares"]
    rows["utilisation"] = f"{u['overall']:.1%}"
    rows["idle: bubble (fill and drain)"] = (
        f"{b['bubble']:.1%} (textbook (N−1)/(M+N−1): {timeline.textbook_bubble():.1%})")
    rows["idle: imbalance, hand-offs, core waits"] = f"{b['imbalance']:.1%}"
    rows["idle: host"] = f"{b['host']:.1%}"
    rows["idle: optimiser step (host)"] = f"{b['step']:.1%}"
    if timeline.memory:
        rows["memory peak per IPU (measured)"] = ", ".join(
            f"{m.name}: {m.peak / 2 ** 20:.3f} MiB" for m in timeline.memory)
    return rows


def _memory(name: str, model, *args):
    """:mod:`ipukit.viz.memory`'s ``name`` of a compiled ``model``, or None where it fails."""
    if model is None or getattr(model, "program", None) is None:
        return None
    from . import memory

    try:
        return getattr(memory, name)(model, *args)
    except Exception:  # noqa: BLE001 - a report without memory beats no report
        return None


def write_profile(timeline: Timeline, directory: str, model=None) -> Dict[str, str]:
    """Write ``<stem>.trace.json`` and ``<stem>.html`` into ``directory``; return their paths.

    The HTML report holds the timeline, the utilisation per IPU and, for a compiled
    ``model``, its memory per stage (also in ``<stem>.memory.json``). Keys of the
    result: ``trace``, ``html`` and ``memory`` when written.
    """
    os.makedirs(directory, exist_ok=True)
    stem = profile_stem(timeline, directory, model)
    paths = {"trace": os.path.join(directory, f"{stem}.trace.json"),
             "html": os.path.join(directory, f"{stem}.html")}
    timeline.to_chrome_trace(paths["trace"])
    report = _memory("memory_report", model)
    measured = _memory("measured_memory", model, timeline) if timeline.memory else None
    if report is not None or timeline.memory:
        paths["memory"] = os.path.join(directory, f"{stem}.memory.json")
        data = report.to_dict() if report is not None else {}
        if timeline.memory:   # the call tracked its memory: measured beside modeled
            data["measured"] = [m.to_dict() for m in timeline.memory]
            if measured is not None:
                data["measured_vs_modeled"] = measured.to_dict()["rows"]
        with open(paths["memory"], "w") as f:
            json.dump(data, f, indent=1)
    try:  # the figures need the viz extra; the trace, the numbers and the memory do not
        from . import plots
    except MissingExtraError as exc:
        parts = [f"<p>{html.escape(str(exc))} (the figures are left out).</p>"]
    else:
        figures = [plots.memory_timeline_figure(timeline, title=f"{stem}") if timeline.memory
                   else plots.timeline_figure(timeline, title=f"{stem}"),
                   plots.utilisation_figure(timeline)]
        if report is not None:
            figures.append(plots.memory_figure(report))
        parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0), default_width="100%")
                 for i, fig in enumerate(figures)]
    table = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                    for k, v in _summary(timeline).items())
    title = html.escape(f"ipukit profile — {stem}")
    page = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
            "<style>body{font-family:Inter,Helvetica,Arial,sans-serif;margin:1.5em;}"
            "table{border-collapse:collapse;margin-bottom:1em}th,td{padding:2px 10px;"
            "text-align:left;border-bottom:1px solid #ddd}th{font-weight:600}</style></head>"
            f"<body><h2>{title}</h2><table>{table}</table>"
            f"<p>Chrome trace: <code>{html.escape(os.path.basename(paths['trace']))}</code> "
            "(open in https://ui.perfetto.dev or chrome://tracing).</p>"
            + "".join(f"<div>{p}</div>" for p in parts) + "</body></html>\n")
    with open(paths["html"], "w", encoding="utf-8") as f:
        f.write(page)
    return paths
