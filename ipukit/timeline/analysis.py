"""The sweeps behind :class:`~ipukit.Timeline`'s pipeline analysis: who waits for whom.

``Timeline``'s idle-time and held-activation measures call these on its events;
measured and modeled timelines answer alike.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, List, Tuple

from .kinds import COMPUTE_KINDS, HOST_KINDS

if TYPE_CHECKING:
    from .events import Event


def activity_marks(events: Iterable["Event"]) -> List[tuple]:
    """The spans that decide who waits for whom, as sorted ``(time, what, ±1)`` marks.

    ``what``: 0 a forward or backward pass on a virtual IPU, 1 an optimiser step,
    2 host work (:data:`HOST_KINDS`); other events (transfers on a track...) are left out.
    """
    marks: List[tuple] = []
    for e in events:
        if e.end <= e.start:
            continue
        if e.kind == "step":
            what = 1
        elif e.ipu >= 0 and e.kind in COMPUTE_KINDS:
            what = 0
        elif e.ipu < 0 and e.kind in HOST_KINDS:
            what = 2
        else:
            continue
        marks.append((e.start, what, 1))
        marks.append((e.end, what, -1))
    marks.sort()
    return marks


def sweep_idle(marks: List[tuple], start: float, P: int,
                parts: Dict[str, float]) -> Tuple[float, float]:
    """Walk the marks in time order, adding IPU-seconds to ``parts``' busy, step and host.

    Idle time while a step runs is ``step``; while only the host works, ``host``; the
    rest belongs to the pipeline. Returns (seconds the pipeline ran, its idle IPU-seconds),
    which :meth:`Timeline.idle_breakdown` splits into bubble and imbalance.
    """
    active = [0, 0, 0]          # busy tracks, steps, host spans
    pipeline_time = pipeline_idle = 0.0
    t = start
    for time, what, delta in marks:
        dt = time - t
        if dt > 0:
            busy = min(active[0], P)
            idle = (P - busy) * dt
            parts["busy"] += busy * dt
            if active[1]:
                parts["step"] += idle
            elif active[2] and busy == 0:
                parts["host"] += idle
            else:
                pipeline_time += dt
                pipeline_idle += idle
            t = time
        active[what] += delta
    return pipeline_time, pipeline_idle
