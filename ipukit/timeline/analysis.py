"""The sweeps behind :class:`~ipukit.Timeline`'s pipeline analysis: who waits for whom.

``Timeline``'s idle-time and held-activation measures call these on its events;
measured and modeled timelines answer alike.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Tuple

from .kinds import BACKWARD_END_KINDS, COMPUTE_KINDS, HOST_KINDS

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


#: the parts of a call's critical path (:func:`critical_path`) besides its passes
PATH_GAPS = ("between passes", "hand-offs", "host")


def critical_path(events: Iterable["Event"], start: float, end: float,
                  one_worker: bool = False) -> Dict[str, Any]:
    """The chain of events that decided when a call ended, walked back from its last one.

    Each event waited for whichever of its predecessors ended last: its inputs (a forward
    the stage before's forward of that micro-batch; a backward or input-gradient half its
    own forward and the next stage's backward of that micro-batch; a weight-gradient half
    its input-gradient half; a step every pass of its iteration) and the event before it
    on its track (its worker's previous action). From ``end`` back to ``start`` the path's
    time splits into its events' own spans (by kind) and the gaps before them: after an
    event of the same worker (``between passes``: its bookkeeping), after another worker's
    (``hand-offs``: the wake-up and anything else that delayed it), or before the path's
    first event and across calls (``host``). ``one_worker``: every track is one worker (a
    sharded call), so no gap is a hand-off. The parts add up to ``end − start`` exactly
    (overlapping spans are counted once, where the later one begins).
    """
    evs = [e for e in events if e.ipu >= 0 and (e.kind in COMPUTE_KINDS or e.kind == "step")
           and e.end >= e.start]
    parts: Dict[str, float] = {k: 0.0 for k in COMPUTE_KINDS + ("step",) + PATH_GAPS}
    if not evs:
        parts["host"] = max(0.0, end - start)
        return {"parts": parts, "events": []}
    by_key: Dict[tuple, "Event"] = {}
    track_before: Dict[int, "Event"] = {}
    flush: Dict[tuple, "Event"] = {}
    tracks: Dict[tuple, List["Event"]] = {}
    for e in sorted(evs, key=lambda e: (e.start, e.end)):
        tracks.setdefault((e.replica, e.ipu), []).append(e)
        if e.kind == "step":
            continue
        by_key[(e.call, e.replica, e.iteration, e.stage, e.kind, e.micro_batch)] = e
        last = flush.get((e.call, e.iteration))
        if last is None or e.end > last.end:
            flush[(e.call, e.iteration)] = e
    for lane in tracks.values():
        for a, b in zip(lane, lane[1:]):
            track_before[id(b)] = a

    def inputs(e: "Event") -> List["Event"]:
        if e.kind == "step":
            return [flush[(e.call, e.iteration)]] if (e.call, e.iteration) in flush else []
        key = (e.call, e.replica, e.iteration)
        found = []
        if e.kind == "forward":
            found.append(by_key.get(key + (e.stage - 1, "forward", e.micro_batch)))
        elif e.kind == "weight-grad":
            found.append(by_key.get(key + (e.stage, "input-grad", e.micro_batch)))
        else:
            found.append(by_key.get(key + (e.stage, "forward", e.micro_batch)))
            for kind in ("backward", "input-grad"):
                found.append(by_key.get(key + (e.stage + 1, kind, e.micro_batch)))
        return [p for p in found if p is not None and p is not e]

    e = max(evs, key=lambda x: (x.end, x.start))
    path = []
    cursor = end
    parts["host"] += max(0.0, cursor - e.end)
    cursor = min(cursor, e.end)
    while True:
        path.append(e)
        parts[e.kind] += max(0.0, cursor - e.start)
        cursor = min(cursor, e.start)
        mine = track_before.get(id(e))
        candidates = inputs(e) + ([mine] if mine is not None else [])
        candidates = [p for p in candidates if p.start < e.start or
                      (p.start == e.start and p.end < e.end)]   # always back in time
        if not candidates:
            break
        p = max(candidates, key=lambda x: (x.end, x.start))
        gap = max(0.0, cursor - p.end)
        if p.call != e.call:
            where = "host"
        elif one_worker or (p.replica, p.ipu) == (e.replica, e.ipu):
            where = "between passes"
        else:
            where = "hand-offs"
        parts[where] += gap
        cursor = min(cursor, p.end)
        e = p
    parts["host"] += max(0.0, cursor - start)
    path.reverse()
    return {"parts": parts, "events": path}
