"""Where a timeline's time goes: the pipeline's bubble, idle time, held activations, stage costs.

A mixin of :class:`~ipukit.Timeline`, kept apart from its basic measures (wall
time, busy time, utilisation, speed) because these read the timeline as a
*pipeline*: they need the schedule's shape (stages, micro-batches) from the
events and ``meta``. Measured and modeled timelines answer alike.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Tuple

from .kinds import BACKWARD_END_KINDS, COMPUTE_KINDS, HOST_KINDS

if TYPE_CHECKING:
    from .events import Event


class _TimelineAnalysis:
    """Pipeline metrics of ``Timeline`` (reads its ``events``, ``meta``, ``tracks()``...)."""

    def textbook_bubble(self) -> float:
        """(N − 1) / (M + N − 1): the idle share of a pipeline of N equal stages and M micro-batches.

        N is the number of stages, M the micro-batches per optimiser step (per
        device iteration for inference); a sharded run is a pipeline of one
        micro-batch at a time, (N − 1) / N.
        """
        meta = self.meta
        ipus = {e.ipu for e in self.device_events()}
        n = int(meta.get("num_stages") or len(ipus) or 1)
        n = min(n, len(ipus)) if ipus else n          # stages sharing an IPU: one row each
        kind = str(meta.get("kind") or meta.get("schedule") or "")
        if kind.startswith("sharded"):
            m = 1
        else:
            m = int(meta.get("micro_batches") or 0) or (
                max((e.micro_batch for e in self.device_events()), default=0) + 1)
        return (n - 1) / (m + n - 1) if n > 1 else 0.0

    def idle_breakdown(self) -> Dict[str, Any]:
        """Where the virtual IPUs' idle time goes, in seconds of IPU time.

        The capacity is wall time × virtual IPUs; what is not ``busy``
        (forwards and backwards) is ``idle``, split into parts that add up to it:

        * ``step`` — every IPU waits while the host steps the optimiser;
        * ``host`` — every IPU waits while the host works alone (cutting the
          input into micro-batches, gathering outputs, combining gradients);
        * ``bubble`` — the pipeline's fill and drain: the textbook share
          (N − 1)/(M + N − 1) (:meth:`textbook_bubble`) of the time the pipeline ran;
        * ``imbalance`` — the rest of the pipeline's idle time: stages of unequal
          cost (the others wait for the slowest), hand-offs between workers, and on
          a CPU, workers waiting for a core.

        ``shares`` holds each part as a fraction of the capacity, with ``busy``;
        the shares add up to 1. For equal stage costs and nothing else, ``bubble``
        is exactly the textbook share and ``imbalance`` 0.
        """
        tracks = self.tracks()
        P = len(tracks)
        parts = {"busy": 0.0, "bubble": 0.0, "imbalance": 0.0, "host": 0.0, "step": 0.0}
        out: Dict[str, Any] = {"ipus": P, "wall": self.wall_time,
                               "capacity": P * self.wall_time,
                               "textbook_bubble": self.textbook_bubble()}
        if P == 0 or self.wall_time <= 0:
            out.update(parts, idle=0.0, pipeline=0.0,
                       shares={k: 0.0 for k in parts})
            return out
        marks = _activity_marks(self.events)
        pipeline_time, pipeline_idle = _sweep_idle(marks, self.start, P, parts)
        bubble = min(pipeline_idle, out["textbook_bubble"] * P * pipeline_time)
        parts["bubble"] = bubble
        parts["imbalance"] = pipeline_idle - bubble
        capacity = out["capacity"]
        out.update(parts)
        out["idle"] = capacity - parts["busy"]
        out["pipeline"] = pipeline_time
        out["shares"] = {k: v / capacity for k, v in parts.items()}
        return out

    def peak_in_flight(self) -> Dict[int, int]:
        """Per stage, the most micro-batches whose activations are held at once (replica 0).

        A micro-batch is held from the start of its forward pass to the end of its
        backward pass on that stage: the activation stash a schedule needs (GPipe: M on
        every stage; ipukit's 1F1B: N − s on stage s). Inference holds none past a pass.
        """
        out: Dict[int, int] = {}
        by_stage: Dict[int, List[tuple]] = {}
        for e in self.events:
            if e.replica != 0 or e.stage < 0:
                continue
            if e.kind == "forward":
                by_stage.setdefault(e.stage, []).append((e.start, 1))
            elif e.kind in BACKWARD_END_KINDS:
                by_stage.setdefault(e.stage, []).append((e.end, -1))
        training = any(e.kind in BACKWARD_END_KINDS for e in self.events)
        for stage, marks in sorted(by_stage.items()):
            if not training:
                out[stage] = 1 if marks else 0
                continue
            level = peak = 0
            for _, delta in sorted(marks):          # at equal times, a release comes first
                level += delta
                peak = max(peak, level)
            out[stage] = peak
        return out

    def stage_costs(self, statistic: str = "median") -> Dict[str, List[float]]:
        """Per-stage forward/backward/step times, for :func:`ipukit.simulate`.

        A split backward (``input-grad`` then ``weight-grad``) counts as one
        backward of their summed cost, and its halves are reported too.
        """
        import statistics

        agg = getattr(statistics, statistic)
        stages = sorted({e.stage for e in self.device_events() if e.stage >= 0})
        out: Dict[str, List[float]] = {"forward": [], "backward": [], "step": []}
        split = any(e.kind == "input-grad" for e in self.events)
        kinds = list(out) + (["input-grad", "weight-grad"] if split else [])
        for kind in kinds:
            out[kind] = []
            for s in stages:
                d = [e.duration for e in self.events if e.stage == s and e.kind == kind]
                out[kind].append(agg(d) if d else 0.0)
        if split:
            out["backward"] = [b if b else i + w for b, i, w in
                               zip(out["backward"], out["input-grad"], out["weight-grad"])]
        return out


def _activity_marks(events: Iterable["Event"]) -> List[tuple]:
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


def _sweep_idle(marks: List[tuple], start: float, P: int,
                parts: Dict[str, float]) -> Tuple[float, float]:
    """Walk the marks in time order, adding IPU-seconds to ``parts``' busy, step and host.

    Idle time while a step runs is ``step``; while only the host works, ``host``; the
    rest belongs to the pipeline. Returns (seconds the pipeline ran, its idle IPU-seconds),
    which :meth:`_TimelineAnalysis.idle_breakdown` splits into bubble and imbalance.
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
