"""The schedule model: time a :class:`~ipukit.schedule.Schedule` with given costs.

The model runs the very schedule the executor runs — same lanes, same order,
same dependencies — with costs instead of work, and returns a
:class:`~ipukit.Timeline` marked ``modeled``. Costs can be scalars or per-stage
lists, or come straight from a measured timeline (:func:`costs_from`).
"""
from __future__ import annotations

import gc
import heapq
from collections import deque
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .schedule import BACKWARD, FORWARD, STEP, Action, Schedule, build
from .timeline import Event, KIND_NAMES, Timeline

Cost = Union[float, Sequence[float]]


@contextmanager
def _gc_paused():
    """Hold off the cyclic garbage collector while building many small tuples.

    The tuples hold no cycles, but allocating tens of thousands of them
    triggers a full collection over every object torch has created, which
    costs more than the whole model run (0.15–0.2 s for 16 stages × 1024
    micro-batches on a 2-core machine).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _per_stage(value: Cost, n: int, name: str) -> List[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name}: expected one cost per stage ({n}), got {len(values)}")
    return values


def play(lanes: List[List[Action]], num_stages: int, costs: Dict[str, Sequence[float]],
         transfers: Optional[Dict[str, Sequence[float]]] = None,
         start_time: float = 0.0) -> List[List[Tuple[float, float]]]:
    """Run lanes with per-stage costs; return (start, end) of every action, per lane.

    ``costs[kind][stage]`` is the duration of an action (kind ``"F"``, ``"B"``,
    ``"S"``); ``transfers[kind][stage]`` is added when that action waits on
    another stage. Each lane runs its actions in order. A forward waits for the
    previous stage's forward, a backward for the next stage's backward, and an
    optimiser step for every lane to finish the iteration's forwards and
    backwards (the flush).
    """
    zero = [0.0] * num_stages
    transfers = transfers or {}
    t_fwd = transfers.get(FORWARD, zero)
    t_bwd = transfers.get(BACKWARD, zero)
    c_fwd, c_bwd, c_step = costs[FORWARD], costs[BACKWARD], costs.get(STEP, zero)
    n_lanes = len(lanes)
    stage_lane = [None] * num_stages
    n_iter, width = 1, 1
    for li, lane in enumerate(lanes):
        for a in lane:
            if stage_lane[a[1]] is None:
                stage_lane[a[1]] = li
            if a[3] >= n_iter:
                n_iter = a[3] + 1
            if a[2] >= width:
                width = a[2] + 1
    remaining = [0] * n_iter
    for lane in lanes:
        for a in lane:
            if a[0] != STEP:
                remaining[a[3]] += 1
    flushed = [None] * n_iter
    flush_end = [-1.0] * n_iter
    # end times of forwards / backwards, by stage then (iteration * width + micro-batch)
    fdone = [[None] * (n_iter * width) for _ in range(num_stages)]
    bdone = [[None] * (n_iter * width) for _ in range(num_stages)]
    times: List[List[Tuple[float, float]]] = [[] for _ in lanes]
    pos = [0] * n_lanes
    free = [start_time] * n_lanes
    queue = deque(range(n_lanes))
    queued = [True] * n_lanes
    last = num_stages - 1
    while queue:
        li = queue.popleft()
        queued[li] = False
        lane = lanes[li]
        append = times[li].append
        p = pos[li]
        t = free[li]
        n = len(lane)
        while p < n:
            kind, s, m, it = lane[p]
            if kind == STEP:
                dep = flushed[it]
                if dep is None:
                    break
                if dep > t:
                    t = dep
                append((t, t + c_step[s]))
                t += c_step[s]
                p += 1
                continue
            k = it * width + m
            if kind == FORWARD:
                if s > 0:
                    dep = fdone[s - 1][k]
                    if dep is None:
                        break
                    dep += t_fwd[s]
                    if dep > t:
                        t = dep
                begin = t
                t += c_fwd[s]
                fdone[s][k] = t
                wake = stage_lane[s + 1] if s < last else None
            else:
                if s < last:
                    dep = bdone[s + 1][k]
                    if dep is None:
                        break
                    dep += t_bwd[s]
                    if dep > t:
                        t = dep
                begin = t
                t += c_bwd[s]
                bdone[s][k] = t
                wake = stage_lane[s - 1] if s > 0 else None
            append((begin, t))
            p += 1
            if t > flush_end[it]:
                flush_end[it] = t
            remaining[it] -= 1
            if remaining[it] == 0:
                flushed[it] = flush_end[it]
                for w in range(n_lanes):
                    if w != li and not queued[w]:
                        queue.append(w)
                        queued[w] = True
            elif wake is not None and wake != li and not queued[wake]:
                queue.append(wake)
                queued[wake] = True
        pos[li] = p
        free[li] = t
    stuck = [str(lanes[i][pos[i]]) for i in range(n_lanes) if pos[i] < len(lanes[i])]
    if stuck:
        raise RuntimeError(f"schedule deadlocks: lanes wait at {stuck}")
    return times


def simulate(kind: str, num_stages: int, micro_batches: int, forward_cost: Cost = 1.0,
             backward_cost: Cost = 2.0, transfer_cost: float = 0.0, host_overhead: float = 0.0,
             step_cost: Cost = 0.0, iterations: int = 1, replicas: int = 1,
             stage_ipus: Optional[Sequence[int]] = None, samples: Optional[int] = None,
             schedule: Optional[Schedule] = None) -> Timeline:
    """Model one host call of a pipeline and return its (modeled) timeline.

    ``kind`` is ``"gpipe"``, ``"1f1b"``, ``"sharded"`` (training) or
    ``"inference"``, ``"sharded-inference"``. ``micro_batches`` is the
    accumulation window (gradientAccumulation; deviceIterations for inference),
    ``iterations`` the device iterations of a training call. Costs are seconds
    (or any unit) per micro-batch, scalars or one per stage; ``transfer_cost``
    is added between stages on different IPUs; ``host_overhead`` is paid once
    per call before the first micro-batch (what device iterations amortise).

    For equal stage costs and no overheads, GPipe's utilisation is exactly
    M / (M + N − 1).
    """
    N = int(num_stages)
    fwd = _per_stage(forward_cost, N, "forward_cost")
    bwd = _per_stage(backward_cost, N, "backward_cost")
    stp = _per_stage(step_cost, N, "step_cost")
    with _gc_paused():  # tens of thousands of small tuples: see _gc_paused
        if schedule is None:
            schedule = build(kind, N, micro_batches, iterations, stage_ipus)
        ipus = schedule.stage_ipus
        t_fwd = [transfer_cost if s > 0 and ipus[s - 1] != ipus[s] else 0.0 for s in range(N)]
        t_bwd = [transfer_cost if s < N - 1 and ipus[s + 1] != ipus[s] else 0.0 for s in range(N)]
        times = play(schedule.lanes, N, {FORWARD: fwd, BACKWARD: bwd, STEP: stp},
                     {FORWARD: t_fwd, BACKWARD: t_bwd}, start_time=host_overhead)
        events = []
        if host_overhead > 0:
            events.append(Event(-1, "host", -1, 0.0, host_overhead, -1, 0, 0, 0))
        new = tuple.__new__
        names = KIND_NAMES
        for replica in range(replicas):
            for lane, lane_times in zip(schedule.lanes, times):
                events += [new(Event, (s, names[kind], m, start, end, ipus[s], replica, it, 0))
                           for (kind, s, m, it), (start, end) in zip(lane, lane_times)]
    meta = {"schedule": schedule.kind, "kind": schedule.kind, "num_stages": N,
            "micro_batches": micro_batches,
            "iterations": iterations, "replicas": replicas,
            "forward_cost": fwd, "backward_cost": bwd, "step_cost": stp,
            "transfer_cost": transfer_cost, "host_overhead": host_overhead}
    if samples is not None:
        meta["samples"] = samples
    return Timeline(events, modeled=True, meta=meta)


def costs_from(timeline: Timeline, statistic: str = "median") -> Dict[str, List[float]]:
    """Per-stage forward/backward/step costs measured in ``timeline`` (its medians).

    ``simulate(kind, N, M, **costs_from(measured))`` is "modeled from this machine".
    """
    c = timeline.stage_costs(statistic)
    return {"forward_cost": c["forward"], "backward_cost": c["backward"], "step_cost": c["step"]}


# -- modeling a measured run "from this machine" -------------------------------------------

def play_on_cores(lanes: List[List[Action]], num_stages: int, costs: Dict[str, Sequence[float]],
                  cores: int, transfers: Optional[Dict[str, Sequence[float]]] = None,
                  start_time: float = 0.0, replicas: int = 1
                  ) -> List[List[List[Tuple[float, float]]]]:
    """Like :func:`play`, but at most ``cores`` forwards/backwards run at once.

    A CPU runs one worker per lane and replica; when there are more workers
    than cores, a ready action waits until a core is free (earliest-ready
    first). Optimiser steps are one host operation in the executor (every
    stage's step event is the same span), so they do not take a core.
    Returns ``times[replica][lane]`` = (start, end) per action. With enough
    cores the result equals :func:`play`'s.
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    zero = [0.0] * num_stages
    transfers = transfers or {}
    shift = {FORWARD: transfers.get(FORWARD, zero), BACKWARD: transfers.get(BACKWARD, zero)}
    cost = {FORWARD: costs[FORWARD], BACKWARD: costs[BACKWARD], STEP: costs.get(STEP, zero)}
    workers = [(r, li) for r in range(replicas) for li in range(len(lanes))]
    remaining: Dict[int, int] = {}
    for lane in lanes:
        for a in lane:
            if a[0] != STEP:
                remaining[a[3]] = remaining.get(a[3], 0) + replicas
    flush_end: Dict[int, float] = {}
    flushed: Dict[int, float] = {}
    done: Dict[tuple, float] = {}           # (kind, replica, stage, iteration, micro-batch) -> end
    pos = [0] * len(workers)
    free = [start_time] * len(workers)
    times = [[[] for _ in lanes] for _ in range(replicas)]
    waiting = {w for w, (_, li) in enumerate(workers) if lanes[li]}   # next action not queued
    ready: list = []                        # (ready time, worker) of actions waiting for a core
    running: list = []                      # (end, worker, start) of actions holding a core

    def ready_time(w: int) -> Optional[float]:
        r, li = workers[w]
        kind, s, m, it = lanes[li][pos[w]]
        if kind == STEP:
            dep = flushed.get(it)
        elif kind == FORWARD and s > 0:
            dep = done.get((FORWARD, r, s - 1, it, m))
            dep = None if dep is None else dep + shift[FORWARD][s]
        elif kind == BACKWARD and s < num_stages - 1:
            dep = done.get((BACKWARD, r, s + 1, it, m))
            dep = None if dep is None else dep + shift[BACKWARD][s]
        else:  # the first stage's forward, the last stage's backward: only lane order
            dep = free[w]
        if dep is None:
            return None
        return max(dep, free[w])

    def finish(w: int, begin: float, end: float) -> None:
        r, li = workers[w]
        kind, s, m, it = lanes[li][pos[w]]
        times[r][li].append((begin, end))
        pos[w] += 1
        free[w] = end
        if kind != STEP:
            done[(kind, r, s, it, m)] = end
            flush_end[it] = max(flush_end.get(it, end), end)
            remaining[it] -= 1
            if remaining[it] == 0:
                flushed[it] = flush_end[it]
        if pos[w] < len(lanes[li]):
            waiting.add(w)

    def release() -> None:
        """Queue every waiting worker whose next action's inputs exist; run steps at once."""
        progress = True
        while progress:
            progress = False
            for w in sorted(waiting):
                t = ready_time(w)
                if t is None:
                    continue
                waiting.discard(w)
                r, li = workers[w]
                kind, s = lanes[li][pos[w]][:2]
                if kind == STEP:
                    finish(w, t, t + cost[STEP][s])
                    progress = True
                else:
                    heapq.heappush(ready, (t, w))

    now = start_time
    release()
    while ready or running:
        while ready and len(running) < cores and ready[0][0] <= now:
            t, w = heapq.heappop(ready)
            r, li = workers[w]
            kind, s = lanes[li][pos[w]][:2]
            heapq.heappush(running, (now + cost[kind][s], w, now))
        candidates = [running[0][0]] if running else []
        if ready and len(running) < cores:
            candidates.append(ready[0][0])
        now = max(now, min(candidates))
        while running and running[0][0] <= now:
            end, w, begin = heapq.heappop(running)
            finish(w, begin, end)
        release()
    stuck = [str(lanes[workers[w][1]][pos[w]]) for w in range(len(workers))
             if pos[w] < len(lanes[workers[w][1]])]
    if stuck:
        raise RuntimeError(f"schedule deadlocks: lanes wait at {stuck}")
    return times


def _host_spans(measured: Timeline) -> Tuple[float, float]:
    """Host time before the first and after the last device event of a measured call."""
    device = measured.device_events()
    if not device:
        return 0.0, 0.0
    first = min(e.start for e in device)
    last = max(e.end for e in device)
    host = [e for e in measured.events if e.ipu < 0]
    before = sum(e.duration for e in host if e.end <= first)
    after = sum(e.duration for e in host if e.start >= last)
    return before, after


def model_like(measured_timeline: Timeline, cores: Optional[int] = None, host: bool = True,
               statistic: str = "median",
               costs: Optional[Dict[str, Sequence[float]]] = None) -> Timeline:
    """Model a measured call "from this machine": same schedule, its measured stage costs.

    The schedule (kind, stages, micro-batches, iterations, stage IPUs, replicas)
    comes from ``measured_timeline.meta``; every forward/backward/step costs the stage's
    ``statistic`` over the measured events, or ``costs`` when given (a
    ``Timeline.stage_costs()`` dict, e.g. of an uncontended sharded run of the
    same stages); with ``host`` the call's set-up and output-gathering spans
    are kept, so wall time and utilisation compare like for like. ``cores``
    models a CPU that can run at most that many actions at once (see
    :func:`play_on_cores`); ``None`` means one core per worker.
    """
    measured = measured_timeline
    meta = measured.meta
    try:
        kind = meta["kind"] if "kind" in meta else meta["schedule"]
        N, M = int(meta["num_stages"]), int(meta["micro_batches"])
    except KeyError as missing:
        raise ValueError(f"model_like needs a measured timeline with schedule metadata (meta "
                         f"lacks {missing}); use ipukit.simulate with explicit costs") from None
    iterations = int(meta.get("iterations", 1))
    replicas = int(meta.get("replicas", 1))
    stage_ipus = meta.get("stage_ipus")
    schedule = build(kind, N, M, iterations, stage_ipus)
    c = measured.stage_costs(statistic) if costs is None else {
        k: [float(v) for v in costs.get(k, [0.0] * N)] for k in ("forward", "backward", "step")}
    if any(len(v) != N for v in c.values()):
        raise ValueError(f"costs: expected one value per stage ({N}) for forward/backward/step")
    if not schedule.training:
        c["backward"], c["step"] = [0.0] * N, [0.0] * N
    before, after = _host_spans(measured) if host else (0.0, 0.0)
    samples = meta.get("samples")
    if cores is None:
        tl = simulate(kind, N, M, c["forward"], c["backward"], step_cost=c["step"],
                      host_overhead=before, iterations=iterations, replicas=replicas,
                      samples=samples, schedule=schedule)
    else:
        tl = _simulate_on_cores(schedule, c, int(cores), before, replicas, samples)
    if after > 0:
        end = tl.end
        tl.events.append(Event(-1, "host", -1, end, end + after, -1, 0, iterations - 1, 0))
    tl.meta.update({"modeled_from": meta.get("call"), "cores": cores, "statistic": statistic,
                    "host_after": after})
    return tl


def _simulate_on_cores(schedule: Schedule, c: Dict[str, List[float]], cores: int,
                       host_overhead: float, replicas: int, samples) -> Timeline:
    N = schedule.num_stages
    costs = {FORWARD: c["forward"], BACKWARD: c["backward"], STEP: c["step"]}
    ipus = schedule.stage_ipus
    events = []
    if host_overhead > 0:
        events.append(Event(-1, "host", -1, 0.0, host_overhead, -1, 0, 0, 0))
    with _gc_paused():
        times = play_on_cores(schedule.lanes, N, costs, cores, start_time=host_overhead,
                              replicas=replicas)
        for replica in range(replicas):
            for lane, lane_times in zip(schedule.lanes, times[replica]):
                events += [Event(s, KIND_NAMES[kind], m, start, end, ipus[s], replica, it, 0)
                           for (kind, s, m, it), (start, end) in zip(lane, lane_times)]
    meta = {"schedule": schedule.kind, "num_stages": N, "micro_batches": schedule.micro_batches,
            "iterations": schedule.iterations, "replicas": replicas,
            "forward_cost": c["forward"], "backward_cost": c["backward"], "step_cost": c["step"],
            "transfer_cost": 0.0, "host_overhead": host_overhead}
    if samples is not None:
        meta["samples"] = samples
    return Timeline(events, modeled=True, meta=meta)
