"""The schedule model: time a :class:`~ipukit.schedule.Schedule` with given costs.

The model runs the very schedule the executor runs — same lanes, same order,
same dependencies — with costs instead of work, and returns a
:class:`~ipukit.Timeline` marked ``modeled``. Costs can be scalars or per-stage
lists, or come straight from a measured timeline (:func:`costs_from`).
"""
from __future__ import annotations

import gc
import heapq
from collections import Counter
from contextlib import contextmanager
from itertools import repeat
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..schedules.build import build
from ..schedules.ir import (BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, Action, Schedule,
                            ScheduleError, walk)
from .events import COMPUTE_KINDS, Event, KIND_NAMES, Timeline

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


def per_stage(value: Cost, n: int, name: str) -> List[float]:
    """A scalar cost for each of ``n`` stages, or a list checked to have ``n`` values."""
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name}: expected one cost per stage ({n}), got {len(values)}")
    return values


def play(lanes: List[List[Action]], num_stages: int, costs: Dict[str, Sequence[float]],
         transfers: Optional[Dict[str, Sequence[float]]] = None,
         start_time: float = 0.0) -> List[List[Tuple[float, float]]]:
    """(start, end) of every action, per lane, with one core per worker.

    ``costs[kind][stage]`` is the duration of an action (kind ``"F"``, ``"B"``,
    ``"I"``, ``"W"``, ``"S"``); ``transfers[kind][stage]`` is added when that
    action waits on another stage. The rules are :func:`ipukit.schedule.walk`'s.
    """
    return walk(lanes, num_stages, costs, transfers, start_time)[0]


def simulate(kind: str, num_stages: int, micro_batches: int, forward_cost: Cost = 1.0,
             backward_cost: Cost = 2.0, transfer_cost: float = 0.0, host_overhead: float = 0.0,
             step_cost: Cost = 0.0, iterations: int = 1, replicas: int = 1,
             stage_ipus: Optional[Sequence[int]] = None, samples: Optional[int] = None,
             schedule: Optional[Schedule] = None, weight_share: float = 0.5,
             input_grad_cost: Optional[Cost] = None,
             weight_grad_cost: Optional[Cost] = None,
             exposed_transfers: bool = False) -> Timeline:
    """Model one host call of a pipeline and return its (modeled) timeline.

    ``kind`` is ``"gpipe"``, ``"1f1b"``, ``"sharded"`` (training) or
    ``"inference"``, ``"sharded-inference"``. ``micro_batches`` is the
    accumulation window (gradientAccumulation; deviceIterations for inference),
    ``iterations`` the device iterations of a training call. Costs are seconds
    (or any unit) per micro-batch, scalars or one per stage; ``transfer_cost``
    is added between stages on different IPUs; ``host_overhead`` is paid once
    per call before the first micro-batch (what device iterations amortise).

    Every kind of :data:`ipukit.schedule.KINDS` is modeled, the modern ones
    (:mod:`ipukit.schedules`) on the placement they need unless ``stage_ipus``
    says otherwise; a split backward costs ``(1 − weight_share) × backward`` for
    its input-gradient half and ``weight_share × backward`` for its weight half
    (or ``input_grad_cost`` / ``weight_grad_cost`` when given, e.g. measured).

    ``exposed_transfers``: a send to another IPU also occupies the sender for
    ``transfer_cost`` (communication not overlapped with compute), except DualPipeV's
    paired forward and backward, whose sends overlap the partner's compute
    (:func:`play_shared`); by default a transfer is latency only (the receiver waits).

    For equal stage costs and no overheads, GPipe's utilisation is exactly
    M / (M + N − 1).
    """
    N = int(num_stages)
    fwd = per_stage(forward_cost, N, "forward_cost")
    bwd = per_stage(backward_cost, N, "backward_cost")
    stp = per_stage(step_cost, N, "step_cost")
    with _gc_paused():  # tens of thousands of small tuples: see _gc_paused
        if schedule is None:
            schedule = build(kind, N, micro_batches, iterations, stage_ipus)
        ipus = schedule.stage_ipus
        t_fwd = [transfer_cost if s > 0 and ipus[s - 1] != ipus[s] else 0.0 for s in range(N)]
        t_bwd = [transfer_cost if s < N - 1 and ipus[s + 1] != ipus[s] else 0.0 for s in range(N)]
        i_cost = None if input_grad_cost is None else per_stage(input_grad_cost, N, "input_grad_cost")
        w_cost = None if weight_grad_cost is None else per_stage(weight_grad_cost, N,
                                                                  "weight_grad_cost")
        costs = split_costs(fwd, bwd, stp, weight_share, i_cost, w_cost)
        if exposed_transfers and transfer_cost:
            hidden = paired_actions(schedule.lanes) if schedule.kind == "dualpipev" else None
            times = play_shared(schedule.lanes, N, costs, {FORWARD: t_fwd, BACKWARD: t_bwd},
                                start_time=host_overhead, exposed=True, hidden=hidden)[0]
        else:
            times = play(schedule.lanes, N, costs, {FORWARD: t_fwd, BACKWARD: t_bwd},
                         start_time=host_overhead)
        events = []
        if host_overhead > 0:
            events.append(Event(-1, "host", -1, 0.0, host_overhead, -1, 0, 0, 0))
        for replica in range(replicas):
            for lane, lane_times in zip(schedule.lanes, times):
                events += lane_events(lane, lane_times, ipus, replica)
    meta = {"schedule": schedule.kind, "kind": schedule.kind, "num_stages": N,
            "micro_batches": micro_batches,
            "iterations": iterations, "replicas": replicas,
            "forward_cost": fwd, "backward_cost": bwd, "step_cost": stp,
            "transfer_cost": transfer_cost, "host_overhead": host_overhead,
            "exposed_transfers": bool(exposed_transfers)}
    if samples is not None:
        meta["samples"] = samples
    return Timeline(events, modeled=True, meta=meta)


def lane_events(lane: Sequence[Action], lane_times: Sequence[Tuple[float, float]],
                ipus: Sequence[int], replica: int, call: int = 0) -> List[Event]:
    """A lane's actions at their modeled times, as events: built column by column in C
    (``zip`` and ``map``; 32,784 events in 7 ms where a comprehension building each
    tuple took 20)."""
    if not lane:
        return []
    kinds, stages, mbs, its = zip(*lane)
    starts, ends = zip(*lane_times)
    return list(map(tuple.__new__, repeat(Event), zip(
        stages, map(KIND_NAMES.__getitem__, kinds), mbs, starts, ends,
        map(ipus.__getitem__, stages), repeat(replica), its, repeat(call))))


def split_costs(fwd: Sequence[float], bwd: Sequence[float], stp: Sequence[float],
                weight_share: float = 0.5, input_grad: Optional[Sequence[float]] = None,
                weight_grad: Optional[Sequence[float]] = None) -> Dict[str, Sequence[float]]:
    """Per-kind action costs; a backward's I and W halves split it by ``weight_share``
    unless measured halves are given."""
    if not 0.0 <= weight_share <= 1.0:
        raise ValueError(f"weight_share must be in [0, 1], got {weight_share}")
    return {FORWARD: list(fwd), BACKWARD: list(bwd), STEP: list(stp),
            INPUT_GRAD: list(input_grad) if input_grad else [b * (1 - weight_share) for b in bwd],
            WEIGHT_GRAD: list(weight_grad) if weight_grad else [b * weight_share for b in bwd]}


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
    first). Optimiser steps are one host operation in the executor, so they do
    not take a core. Returns ``times[replica][lane]`` = (start, end) per
    action. With enough cores the result equals :func:`play`'s.
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return walk(lanes, num_stages, costs, transfers, start_time, cores=cores, replicas=replicas)


def host_spans(measured: Timeline) -> Tuple[float, float]:
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
    same stages). A stage's step cost is the step as drawn on its IPU, once per
    iteration for the whole call: a worker running several stages pays it once.
    With ``host`` the call's set-up and output-gathering spans
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
        k: [float(v) for v in costs.get(k, [0.0] * N)]
        for k in ("forward", "backward", "step", "input-grad", "weight-grad")
        if k in costs or k in ("forward", "backward", "step")}
    if any(len(v) != N for v in c.values()):
        raise ValueError(f"costs: expected one value per stage ({N}) for forward/backward/step")
    if not schedule.training:
        c["backward"], c["step"] = [0.0] * N, [0.0] * N
    # a measured step is drawn on every stage's IPU, but the host steps once per iteration:
    # a lane running several stages (a sharded call, a loop, a V) shares that one step
    c["step"] = [v / k for v, k in zip(c["step"], schedule.stages_in_lane)]
    before, after = host_spans(measured) if host else (0.0, 0.0)
    samples = meta.get("samples")
    if cores is None:
        tl = simulate(kind, N, M, c["forward"], c["backward"], step_cost=c["step"],
                      host_overhead=before, iterations=iterations, replicas=replicas,
                      samples=samples, schedule=schedule, input_grad_cost=c.get("input-grad"),
                      weight_grad_cost=c.get("weight-grad"))
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
    costs = split_costs(c["forward"], c["backward"], c["step"], 0.5, c.get("input-grad"),
                        c.get("weight-grad"))
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


# -- cores shared by workers, and sends a worker waits on -------------------------------------

def rate_of(parallelism: Optional[Sequence[float]], k: int) -> float:
    """Work per second of *each* of ``k`` passes running at once.

    ``parallelism[k - 1]`` is the measured work rate of k concurrent passes on worker
    threads, in units of one pass where the costs were measured (k passes each at that
    speed would be k; a worker's fewer intra-op threads, fewer cores, the interpreter lock
    and the scheduler make it less); beyond the measured list the last value holds.
    ``None``: every pass its own core at the measured speed.
    """
    if not parallelism or k < 1:
        return 1.0
    return _total_rate(parallelism, k) / k


def _total_rate(parallelism: Sequence[float], k: int) -> float:
    total = parallelism[k - 1] if k <= len(parallelism) else parallelism[-1]
    return max(1e-9, min(float(k), float(total)))


def play_shared(lanes: List[List[Action]], num_stages: int, costs: Dict[str, Sequence[float]],
                transfers: Optional[Dict[str, Sequence[float]]] = None, start_time: float = 0.0,
                parallelism: Optional[Sequence[float]] = None, replicas: int = 1,
                exposed: bool = False, hidden: Optional[set] = None,
                lock: Optional[Dict[str, Sequence[float]]] = None, lock_whole: float = 0.0,
                pinned: Optional[Sequence[int]] = None, in_turn: bool = False,
                handovers: Optional[Dict[str, Sequence[float]]] = None
                ) -> List[List[List[Tuple[float, float]]]]:
    """(start, end) of every action, ``times[replica][lane]``, with cores shared fairly.

    The dependency rules are :func:`ipukit.schedule.walk`'s. Unlike its ``cores=`` mode
    (a pass waits for a free core, then runs at full speed), passes here share the CPU:
    while k forwards/backwards run, each advances at ``rate_of(parallelism, k)`` — the
    calibrated rate of k concurrent passes (:func:`ipukit.calibrate`), which holds what
    a core count alone leaves out: the interpreter lock a pass holds for its bookkeeping,
    and the slowdown of more workers than cores. Optimiser steps are the host's and run
    at full speed. ``parallelism=None`` gives every worker its own core (then the result
    equals :func:`play`'s).

    ``transfers[kind][stage]`` is the cost of an activation (``"F"``, paid by the stage
    receiving it) or a gradient (``"B"``) crossing to another IPU. By default it is
    latency only: the receiver waits, the sender does not. With ``exposed`` the sender's
    worker is busy sending (its span grows by the transfer) — unless the action's
    ``(lane, index)`` is in ``hidden``, a send overlapped with a paired action's compute
    (DualPipeV's paired forward and backward), which is latency only again.

    ``lock[kind][stage]``: the share g of each pass's time that it holds the interpreter
    lock (:func:`ipukit.balance.lock_share`, measured beside a twin). While passes run at
    once, each also waits for the lock the others hold: a pass advances at
    ``rate_of(parallelism, k) × (1 + (k − 1) × lock_whole²) / (1 + g × Σ g_others)``, at
    most its speed alone, where ``lock_whole`` is the share of the whole-model passes
    whose rate ``parallelism`` measured (so k whole-model passes still run at that rate,
    and small Python-bound passes that run together, such as a V schedule's last two
    stages, slow each other as they do when measured side by side).

    ``handovers[kind][stage]``: the seconds a pass of another worker loses, per second this
    pass runs beside it, to hand-overs of the interpreter lock (a split backward's ``W``
    makes a gradient call per parameter group and takes the lock back between them, each
    time making a waiting neighbour wait for a wake-up: see
    :meth:`~ipukit.timeline.costs.CostTable.stage_weight_calls`). A running pass advances
    ``1 + Σ η_j`` times slower, over the passes j of other workers running with it.

    ``pinned[w]``: the core worker ``w`` (replica-major, as the executor numbers them) is
    pinned to (:func:`pinned_slots`). Then a core is shared only by the passes pinned to
    it: a pass runs at ``e / n`` with n the passes running on its core and e the
    calibrated efficiency of k passes at once (``parallelism[k − 1] ÷ min(k, cores)``,
    at most 1, as measured by k threads pinned the same way). Passes spread evenly over
    the cores run as without pinning; two on one core while another core idles run at
    half speed each, where fair sharing over all the cores gave them a core each.

    ``in_turn`` (with ``pinned``): each core runs its passes one at a time, oldest first,
    each at ``e``; a pass's span starts when it gets the core (a thread that waits for a
    core has not started its pass). Time slicing (the default) and this are the two ends
    of what Linux did with two workers on one core: in one process a core's pair of
    workers shared it in slices, in the next the same pair took turns whole passes at a
    time (benchmarks/busy_spread.py). The call's time differs by 0.77–1.12× between the two,
    the busy shares by up to 36 points per IPU (:func:`ipukit.calibrate.model_call`
    reports both).
    """
    N, last = num_stages, num_stages - 1
    t_fwd, t_bwd = ((transfers or {}).get(k) or [0.0] * N for k in (FORWARD, BACKWARD))
    cost = {k: costs.get(k) or [0.0] * N for k in (FORWARD, BACKWARD, STEP)}
    for k in (INPUT_GRAD, WEIGHT_GRAD):    # a split half defaults to half a backward
        cost[k] = costs.get(k) or [b / 2 for b in cost[BACKWARD]]
    hidden = hidden or set()

    def send(kind: str, s: int) -> float:
        if kind == FORWARD:
            return t_fwd[s + 1] if s < last else 0.0
        if kind in (BACKWARD, INPUT_GRAD):
            return t_bwd[s - 1] if s > 0 else 0.0
        return 0.0

    workers = [(r, li) for r in range(replicas) for li in range(len(lanes))]
    remaining: Dict[int, int] = {}
    for lane in lanes:
        for a in lane:
            if a[0] != STEP:
                remaining[a[3]] = remaining.get(a[3], 0) + replicas
    flush_end: Dict[int, float] = {}
    flushed: Dict[int, float] = {}
    own: Dict[tuple, float] = {}      # ("F" | "I", replica, stage, iteration, micro-batch): end
    avail: Dict[tuple, float] = {}    # ("F" | "G", ...): when the next stage may use it
    times = [[[] for _ in lanes] for _ in range(replicas)]
    pos = [0] * len(workers)
    free = [start_time] * len(workers)
    waiting = set(w for w, (_, li) in enumerate(workers) if lanes[li])
    ready: list = []                  # (start time, worker)
    running: Dict[int, list] = {}     # worker -> [work left, start]  (passes sharing cores)
    fixed: Dict[int, Tuple[float, float]] = {}   # worker -> (start, end)  (steps; own cores)
    shared = parallelism is not None
    share = {k: (lock or {}).get(k) or [0.0] * N for k in cost}
    handover = {k: (handovers or {}).get(k) or [0.0] * N for k in cost}

    slots = max(pinned) + 1 if pinned else 0
    in_turn = bool(in_turn and pinned)
    now_at = [start_time]             # the model's clock, for a pass that gets its core

    def speeds(now_running: Dict[int, list]) -> Dict[int, float]:
        k = len(now_running)
        if pinned:
            on = Counter(pinned[w] for w in now_running)
            each = min(1.0, _total_rate(parallelism, k) / min(k, slots)) if parallelism else 1.0
            base = {w: each / on[pinned[w]] for w in now_running}
            if in_turn:
                first: Dict[int, int] = {}
                for w in sorted(now_running, key=lambda w: (now_running[w][1], w)):
                    first.setdefault(pinned[w], w)
                k = len(first)       # passes running: one per busy core
                each = min(1.0, _total_rate(parallelism, k) / k) if parallelism else 1.0
                base = {w: each if first[pinned[w]] == w else 0.0 for w in now_running}
                for w in first.values():
                    if len(now_running[w]) < 4:
                        now_running[w].append(now_at[0])    # the pass gets its core
        else:
            base = dict.fromkeys(now_running, rate_of(parallelism, k))
        if k < 2:
            return base
        if lock:
            lift = 1 + (k - 1) * lock_whole ** 2
            total = sum(v[2] for w, v in now_running.items() if base[w] > 0)
            base = {w: min(1.0, base[w] * lift) / (1 + v[2] * (total - v[2]))
                    for w, v in now_running.items()}
        if handovers:
            eta = {w: handover[lanes[workers[w][1]][pos[w]][0]][lanes[workers[w][1]][pos[w]][1]]
                   for w in now_running if base[w] > 0}
            total = sum(eta.values())
            base = {w: r / (1 + total - eta.get(w, 0.0)) for w, r in base.items()}
        return base

    def dependency(w: int) -> Optional[float]:
        r, li = workers[w]
        kind, s, m, it = lanes[li][pos[w]]
        if kind == STEP:
            dep = flushed.get(it)
        elif kind == FORWARD:
            dep = free[w] if s == 0 else avail.get(("F", r, s - 1, it, m))
        elif kind == WEIGHT_GRAD:
            dep = own.get(("I", r, s, it, m))
        else:
            mine = own.get(("F", r, s, it, m))
            if mine is None or s == last:
                dep = mine
            else:
                g = avail.get(("G", r, s + 1, it, m))
                dep = None if g is None else max(g, mine)
        if dep is None:
            return None
        return dep if dep > free[w] else free[w]

    def finish(w: int, start: float, end: float) -> None:
        r, li = workers[w]
        kind, s, m, it = lanes[li][pos[w]]
        times[r][li].append((start, end))
        if kind != STEP:
            out = send(kind, s)
            there = end if exposed and (li, pos[w]) not in hidden else end + out
            if kind == FORWARD:
                own[("F", r, s, it, m)] = end
                avail[("F", r, s, it, m)] = there
            elif kind != WEIGHT_GRAD:
                avail[("G", r, s, it, m)] = there
                if kind == INPUT_GRAD:
                    own[("I", r, s, it, m)] = end
            flush_end[it] = max(flush_end.get(it, start_time), end)
            remaining[it] -= 1
            if remaining[it] == 0:
                flushed[it] = flush_end[it]
        pos[w] += 1
        free[w] = end
        if pos[w] < len(lanes[li]):
            waiting.add(w)

    now = start_time
    inf = float("inf")
    while True:
        for w in list(waiting):
            t = dependency(w)
            if t is not None:
                waiting.discard(w)
                heapq.heappush(ready, (t, w))
        now_at[0] = now
        rate = speeds(running) if running else {}
        t_done = now + min(v[0] / rate[w] for w, v in running.items() if rate[w] > 0) \
            if running else inf
        t_fixed = min((e for _, e in fixed.values()), default=inf)
        t_ready = ready[0][0] if ready else inf
        nxt = min(t_done, t_fixed, t_ready)
        if nxt == inf:
            break
        if running and nxt > now:
            for w, v in running.items():
                v[0] -= (nxt - now) * rate[w]
        now = max(now, nxt)
        if running and nxt == t_done:
            for w in [w for w, v in running.items() if v[0] <= 1e-12 * (1 + abs(now))]:
                v = running.pop(w)
                finish(w, v[3] if len(v) > 3 else v[1], now)
        for w in [w for w, (_, e) in fixed.items() if e <= now]:
            start, end = fixed.pop(w)
            finish(w, start, end)
        while ready and ready[0][0] <= now:
            t, w = heapq.heappop(ready)
            r, li = workers[w]
            kind, s, m, it = lanes[li][pos[w]]
            work = cost[kind][s]
            if exposed and kind != STEP and (li, pos[w]) not in hidden:
                work += send(kind, s)
            if shared and kind != STEP:
                running[w] = [work, t, share[kind][s]]
            else:
                fixed[w] = (t, t + work)
    stuck = [str(lanes[li][pos[w]]) for w, (_, li) in enumerate(workers)
             if pos[w] < len(lanes[li])]
    if stuck:
        raise ScheduleError(f"schedule deadlocks: lanes wait at {stuck}")
    return times


def paired_actions(lanes: List[List[Action]]) -> set:
    """DualPipeV's overlapped pairs: a forward next to a full backward of the lane's other
    stage (ipukit writes torch's ``OVERLAP_F_B`` as the forward, then the backward).
    Returns the ``(lane, index)`` of both actions of every pair."""
    out = set()
    for li, lane in enumerate(lanes):
        i = 0
        while i + 1 < len(lane):
            a, b = lane[i], lane[i + 1]
            if a[0] == FORWARD and b[0] == BACKWARD and a[1] != b[1]:
                out.update({(li, i), (li, i + 1)})
                i += 2
            else:
                i += 1
    return out


# -- costs a contended run's passes would have had alone ----------------------------------------

def pinned_slots(workers: int, cores: Optional[int] = None) -> Optional[List[int]]:
    """Which of ``cores`` (default :func:`available_cores`) each of ``workers`` worker
    threads is pinned to, ``i`` mod the cores, or None where the executor leaves them free:
    with no more workers than cores, where the OS cannot pin a thread, or with
    ``IPUKIT_PIN_WORKERS=0`` (the rule :func:`ipukit.runtime.executor.worker_cores` applies,
    and the model shares each core among the workers pinned to it)."""
    import os

    if not hasattr(os, "sched_setaffinity") or os.environ.get("IPUKIT_PIN_WORKERS") == "0":
        return None
    cores = available_cores() if cores is None else int(cores)
    if cores < 1 or workers <= cores:
        return None
    return [i % cores for i in range(workers)]


def available_cores() -> int:
    """Cores this process may run on: what the executor shares among its workers.

    The executor sizes its workers' threads by the process's CPU affinity
    (``os.sched_getaffinity``), which can be fewer than ``os.cpu_count()``
    (containers, ``taskset``); model with the same number.
    """
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def uncontended_costs(timeline: Timeline, cores: Optional[int] = None,
                      statistic: str = "median") -> Dict[str, List[float]]:
    """Per-stage costs of ``timeline``'s passes as if each had had a core to itself.

    A measured span is wall time: when more workers run than there are
    ``cores`` (default :func:`available_cores`), each pass shares a core and
    its span stretches. This estimates each pass's own work by integrating,
    over its span, the share of a core it had — ``min(1, cores / running)``
    where ``running`` counts the forwards and backwards in progress — which
    holds when workers share cores fairly (one intra-op thread each, as the
    executor sets them). Returns ``Timeline.stage_costs()``'s dict, ready for
    ``model_like(measured, cores=cores, costs=...)``: replaying these costs
    on ``cores`` cores models the contention once, not twice.
    """
    import statistics as stats

    cores = available_cores() if cores is None else int(cores)
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    passes = [e for e in timeline.device_events() if e.kind in COMPUTE_KINDS]
    marks = sorted([(e.start, 1) for e in passes] + [(e.end, -1) for e in passes])
    # cumulative core-seconds a running pass has received, at each mark
    times, credit = [], []
    running, total, t = 0, 0.0, None
    for time, delta in marks:
        if t is not None and time > t and running:
            total += (time - t) * min(1.0, cores / running)
        times.append(time)
        credit.append(total)
        running += delta
        t = time
    import bisect

    def received(a: float) -> float:
        i = bisect.bisect_right(times, a) - 1
        return credit[i] if i >= 0 else 0.0

    agg = getattr(stats, statistic)
    stages = sorted({e.stage for e in timeline.device_events() if e.stage >= 0})
    own: Dict[tuple, List[float]] = {}
    for e in passes:
        own.setdefault((e.kind, e.stage), []).append(received(e.end) - received(e.start))
    out: Dict[str, List[float]] = {"forward": [], "backward": [], "step": []}
    steps = timeline.stage_costs(statistic)["step"]
    split = any(e.kind == "input-grad" for e in passes)
    for kind in ("forward", "backward") + (("input-grad", "weight-grad") if split else ()):
        out[kind] = [agg(own[(kind, s)]) if own.get((kind, s)) else 0.0 for s in stages]
    if split:  # a stage's backward, when it ran split: its two halves
        out["backward"] = [b or i + w for b, i, w in
                           zip(out["backward"], out["input-grad"], out["weight-grad"])]
    out["step"] = list(steps)
    return out
