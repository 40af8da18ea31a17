"""A timeline: what each virtual IPU did, and when.

Measured timelines (from the executor) and modeled ones (from
:func:`ipukit.simulate`) are the same type, so every metric, figure and export
works on both. Times are seconds from the start of the call.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

from .analysis import activity_marks, sweep_idle
# the kinds have always been importable from here
from .kinds import BACKWARD_END_KINDS, COMPUTE_KINDS, HOST_KINDS, KIND_NAMES


class Event(NamedTuple):
    """One span of work on one virtual IPU (``stage`` -1 / ``ipu`` -1: the host)."""

    stage: int
    kind: str                 # forward | backward | step | transfer | host
    micro_batch: int
    start: float
    end: float
    ipu: int = 0
    replica: int = 0
    iteration: int = 0
    call: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def track(self) -> str:
        if self.ipu < 0:
            return "host"
        return f"IPU {self.ipu}" if self.replica == 0 else f"IPU {self.ipu} · replica {self.replica}"


@dataclass
class MemoryTrack:
    """Bytes really alive on one virtual IPU over a call, measured (see ``ipukit.runtime.memory_track``).

    ``samples``: (seconds from the call's start, bytes alive), coalesced, the peak kept;
    ``baseline`` (alive at the start), ``peak`` (at ``peak_time``), ``end``; ``parts``: the
    baseline's parts in bytes. ``allocator_peak``: ``torch.cuda.max_memory_allocated`` over the
    call (GPU only); ``rss_peak``: off GPU, the process's peak resident set size before and after
    the call. ``ipu`` -1: one thread ran every IPU.
    """

    ipu: int
    replica: int = 0
    samples: List[tuple] = field(default_factory=list)
    baseline: int = 0
    peak: int = 0
    peak_time: float = 0.0
    end: int = 0
    parts: Dict[str, int] = field(default_factory=dict)
    allocator_peak: Optional[int] = None
    rss_peak: Optional[Tuple[int, int]] = None

    @property
    def name(self) -> str:
        ipu = "all IPUs" if self.ipu < 0 else f"IPU {self.ipu}"
        return ipu if self.replica == 0 else f"{ipu} · replica {self.replica}"

    def shifted(self, offset: float) -> "MemoryTrack":
        return replace(self, samples=[(t + offset, b) for t, b in self.samples],
                       peak_time=self.peak_time + offset, parts=dict(self.parts))

    def to_dict(self) -> Dict[str, Any]:
        return {"ipu": self.ipu, "replica": self.replica, "baseline": self.baseline,
                "peak": self.peak, "peak_time": self.peak_time, "end": self.end,
                "parts": dict(self.parts), "allocator_peak": self.allocator_peak,
                "rss_peak": None if self.rss_peak is None else list(self.rss_peak),
                "samples": [list(s) for s in self.samples]}


@dataclass
class Timeline:
    """Events of one (or more) model calls, plus what produced them: measures (utilisation,
    speed), pipeline analysis (bubble, idle breakdown, held activations, stage costs), exports."""

    events: List[Event] = field(default_factory=list)
    modeled: bool = False
    meta: Dict[str, Any] = field(default_factory=dict)
    #: measured bytes alive per virtual IPU over the call (empty unless memory was tracked)
    memory: List[MemoryTrack] = field(default_factory=list)

    # -- basic measures -------------------------------------------------------
    @property
    def label(self) -> str:
        return "modeled" if self.modeled else "measured"

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def end(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    @property
    def wall_time(self) -> float:
        """Seconds from the first event's start to the last event's end."""
        return self.end - self.start

    def device_events(self) -> List[Event]:
        return [e for e in self.events if e.ipu >= 0]

    def tracks(self) -> List[tuple]:
        """(replica, ipu) of every virtual IPU that appears, sorted."""
        return sorted({(e.replica, e.ipu) for e in self.device_events()})

    def busy_time(self) -> Dict[tuple, float]:
        """Seconds of forward and backward passes per (replica, ipu) track."""
        busy: Dict[tuple, float] = {t: 0.0 for t in self.tracks()}
        for e in self.device_events():
            if e.kind in COMPUTE_KINDS:
                busy[(e.replica, e.ipu)] += e.duration
        return busy

    def utilisation(self) -> Dict[str, Any]:
        """Busy time ÷ wall time, per virtual IPU and ``overall`` (÷ wall × IPUs).

        Busy means a forward or backward pass (the step runs on the host). It explains a
        speed, it is not one: compare runs by :meth:`time_per_step` and :meth:`throughput`.
        Keys: ``per_ipu`` ({ipu: fraction}, replicas averaged), ``per_track``
        ({"IPU i[ · replica r]": fraction}), ``overall``, ``bubble`` (1 − overall).
        """
        wall, busy = self.wall_time, self.busy_time()
        if wall <= 0 or not busy:
            return {"per_ipu": {}, "per_track": {}, "overall": 0.0, "bubble": 1.0}
        per_track = {}
        per_ipu: Dict[int, List[float]] = {}
        for (replica, ipu), b in busy.items():
            name = f"IPU {ipu}" if replica == 0 else f"IPU {ipu} · replica {replica}"
            per_track[name] = b / wall
            per_ipu.setdefault(ipu, []).append(b / wall)
        overall = sum(busy.values()) / (wall * len(busy))
        return {"per_ipu": {i: sum(v) / len(v) for i, v in sorted(per_ipu.items())},
                "per_track": per_track, "overall": overall, "bubble": 1.0 - overall}

    def throughput(self, samples: Optional[int] = None) -> float:
        """Samples per second over the timeline's wall time."""
        samples = self.meta.get("samples") if samples is None else samples
        return samples / self.wall_time if samples and self.wall_time > 0 else 0.0

    @property
    def iterations(self) -> int:
        """Optimiser steps (device iterations) in the timeline, per call."""
        return int(self.meta["iterations"]) if "iterations" in self.meta else (
            max((e.iteration for e in self.events), default=0) + 1)

    def time_per_step(self) -> float:
        """Seconds of wall time per optimiser step (per device iteration for inference)."""
        return self.wall_time / (max(1, self.iterations) * max(1, self.calls))

    def speed(self) -> Dict[str, float]:
        """The numbers to judge a run by: ``wall`` (s), ``time_per_step`` (s), ``samples_per_second``."""
        return {"wall": self.wall_time, "time_per_step": self.time_per_step(),
                "samples_per_second": self.throughput()}

    def host_steps(self) -> List[Event]:
        """The optimiser steps (recorded on every stage's track) folded into one host event
        per (call, iteration, replica)."""
        spans: Dict[tuple, Tuple[float, float]] = {}
        for e in self.events:
            if e.kind == "step":
                key = (e.call, e.iteration, e.replica)
                a, b = spans.get(key, (e.start, e.end))
                spans[key] = (min(a, e.start), max(b, e.end))
        return [Event(-1, "step", -1, a, b, -1, r, it, call)
                for (call, it, r), (a, b) in sorted(spans.items(), key=lambda kv: kv[1][0])]

    def shifted(self, offset: float) -> "Timeline":
        return Timeline([e._replace(start=e.start + offset, end=e.end + offset)
                         for e in self.events], self.modeled, dict(self.meta),
                        [m.shifted(offset) for m in self.memory])

    # -- measured memory -------------------------------------------------------
    def memory_track(self, ipu: int, replica: int = 0) -> Optional[MemoryTrack]:
        """The measured memory of one virtual IPU (None when memory was not tracked)."""
        return next((m for m in self.memory if m.ipu == ipu and m.replica == replica), None)

    def memory_peaks(self) -> Dict[int, int]:
        """Measured peak bytes per virtual IPU (the largest over its replicas); {} if untracked."""
        out: Dict[int, int] = {}
        for m in self.memory:
            out[m.ipu] = max(out.get(m.ipu, 0), m.peak)
        return dict(sorted(out.items()))

    # -- exports ---------------------------------------------------------------
    def to_chrome_trace(self, path: Optional[str] = None) -> Dict[str, Any]:
        """Chrome trace-event JSON (opens in Perfetto / chrome://tracing).

        One process per replica, one thread per virtual IPU plus a host track; complete
        events (``ph: "X"``) in µs; tracked memory adds a counter (``ph: "C"``, MiB) per IPU.
        """
        events: List[Dict[str, Any]] = []
        t0 = self.start
        pids = sorted({max(e.replica, 0) for e in self.events}) or [0]
        for pid in pids:
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"ipukit {self.label} · replica {pid}"}})
        for replica, ipu in self.tracks():
            events.append({"ph": "M", "name": "thread_name", "pid": replica, "tid": ipu + 1,
                           "args": {"name": f"IPU {ipu}"}})
        if any(e.ipu < 0 for e in self.events):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 0,
                           "args": {"name": "host"}})
        for e in self.events:
            name = e.kind if e.micro_batch < 0 else f"{e.kind} mb{e.micro_batch}"
            events.append({
                "name": name, "cat": e.kind, "ph": "X",
                "ts": round((e.start - t0) * 1e6, 3), "dur": round(e.duration * 1e6, 3),
                "pid": max(e.replica, 0), "tid": e.ipu + 1,
                "args": {"stage": e.stage, "micro_batch": e.micro_batch,
                         "iteration": e.iteration, "call": e.call}})
        for m in self.memory:
            name = f"memory {m.name}"
            for t, b in m.samples:
                events.append({"name": name, "cat": "memory", "ph": "C",
                               "ts": round(max(0.0, t - t0) * 1e6, 3), "pid": max(m.replica, 0),
                               "tid": m.ipu + 1, "args": {"MiB": round(b / 2 ** 20, 6)}})
        trace = {"traceEvents": events, "displayTimeUnit": "ms",
                 "otherData": {"ipukit": self.label, **{k: _plain(v) for k, v in self.meta.items()}}}
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

    def to_records(self) -> List[Dict[str, Any]]:
        return [e._asdict() for e in self.events]

    @staticmethod
    def concat(timelines: Iterable["Timeline"]) -> "Timeline":
        """Join consecutive calls' timelines on one time axis.

        The result's ``meta`` is the last call's, with ``samples`` summed, ``calls``, and
        each call's own ``meta`` under ``per_call``.
        """
        out, offset, metas = Timeline(), 0.0, []
        for k, tl in enumerate(timelines):
            shift = offset - tl.start
            for e in tl.events:
                out.events.append(e._replace(start=e.start + shift, end=e.end + shift, call=k))
            out.memory = _join_memory(out.memory, [m.shifted(shift) for m in tl.memory])
            offset += tl.wall_time
            out.modeled = tl.modeled
            metas.append(dict(tl.meta))
        if metas:
            out.meta = {**metas[-1], "calls": len(metas), "per_call": metas}
            samples = [m.get("samples") for m in metas]
            if all(samples):
                out.meta["samples"] = sum(samples)
            else:
                out.meta.pop("samples", None)
        return out

    @property
    def calls(self) -> int:
        """How many model calls the timeline holds (several after :meth:`concat`)."""
        return int(self.meta["calls"]) if "calls" in self.meta else (
            len({e.call for e in self.events}) or 1)

    def time_per_call(self) -> float:
        """Seconds of wall time per model call."""
        return self.wall_time / max(1, self.calls)

    def __repr__(self) -> str:
        u = self.utilisation()["overall"] if self.events else 0.0
        speed = f", {self.throughput():,.0f} samples/s" if self.meta.get("samples") else ""
        return (f"Timeline({self.label}, {len(self.events)} events, "
                f"wall {self.wall_time * 1e3:.2f} ms{speed}, utilisation {u:.1%})")

    # -- pipeline analysis: bubble, idle time, held activations, stage costs -------------

    def textbook_bubble(self) -> float:
        """(N − 1) / (M + N − 1): the idle share of N equal stages and M micro-batches per step.

        A sharded run is a pipeline of one micro-batch at a time, (N − 1) / N.
        """
        meta = self.meta
        ipus = {e.ipu for e in self.device_events()}
        n = int(meta.get("num_stages") or len(ipus) or 1)
        n = min(n, len(ipus)) if ipus else n          # stages sharing an IPU: one row each
        kind = str(meta.get("kind") or meta.get("schedule") or "")
        m = 1 if kind.startswith("sharded") else int(meta.get("micro_batches") or 0) or (
            max((e.micro_batch for e in self.device_events()), default=0) + 1)
        return (n - 1) / (m + n - 1) if n > 1 else 0.0

    def idle_breakdown(self) -> Dict[str, Any]:
        """Where the virtual IPUs' idle time goes, in seconds of IPU time.

        Capacity is wall time × virtual IPUs; what is not ``busy`` is ``idle``: ``step`` (the
        host steps the optimiser), ``host`` (the host works alone), ``bubble`` (fill and drain,
        :meth:`textbook_bubble` of the time the pipeline ran) and ``imbalance`` (the rest:
        unequal stages, hand-offs, core waits). ``shares``: each part ÷ capacity (summing to 1).
        """
        P = len(self.tracks())
        parts = {"busy": 0.0, "bubble": 0.0, "imbalance": 0.0, "host": 0.0, "step": 0.0}
        capacity = P * self.wall_time
        out: Dict[str, Any] = {"ipus": P, "wall": self.wall_time, "capacity": capacity,
                               "textbook_bubble": self.textbook_bubble()}
        if P == 0 or self.wall_time <= 0:
            return {**out, **parts, "idle": 0.0, "pipeline": 0.0,
                    "shares": {k: 0.0 for k in parts}}
        marks = activity_marks(self.events)
        pipeline_time, pipeline_idle = sweep_idle(marks, self.start, P, parts)
        parts["bubble"] = min(pipeline_idle, out["textbook_bubble"] * P * pipeline_time)
        parts["imbalance"] = pipeline_idle - parts["bubble"]
        return {**out, **parts, "idle": capacity - parts["busy"], "pipeline": pipeline_time,
                "shares": {k: v / capacity for k, v in parts.items()}}

    def peak_in_flight(self) -> Dict[int, int]:
        """Per stage, the most micro-batches whose activations are held at once (replica 0).

        Held from the start of its forward to the end of its backward on that stage (GPipe: M;
        1F1B: N − s on stage s); inference holds none past a pass.
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

    def stage_costs(self, statistic="median") -> Dict[str, List[float]]:
        """Per-stage forward/backward/step times, for :func:`ipukit.simulate`.

        ``statistic``: a name in :mod:`statistics` (``"median"``, ``"mean"``) or a function
        of a list of durations. A split backward counts as one backward of its halves' summed
        cost, the halves reported too.
        """
        import statistics

        agg = statistic if callable(statistic) else getattr(statistics, statistic)
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


def _join_memory(before: List[MemoryTrack], after: List[MemoryTrack]) -> List[MemoryTrack]:
    """Consecutive calls' memory tracks, one per (replica, ipu), samples joined."""
    out = {(m.replica, m.ipu): m for m in before}
    for m in after:
        prev = out.get((m.replica, m.ipu))
        if prev is None:
            out[(m.replica, m.ipu)] = m
            continue
        top = prev if prev.peak >= m.peak else m
        peaks = [p for p in (prev.allocator_peak, m.allocator_peak) if p is not None]
        rss = [r for r in (prev.rss_peak, m.rss_peak) if r is not None]
        out[(m.replica, m.ipu)] = MemoryTrack(
            m.ipu, m.replica, prev.samples + m.samples, prev.baseline, top.peak, top.peak_time,
            m.end, dict(prev.parts), max(peaks) if peaks else None,
            (rss[0][0], rss[-1][1]) if rss else None)
    return [out[k] for k in sorted(out)]


def _plain(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)
