"""The schedule model with costs you give: :func:`simulate`.

It runs the very schedule the executor runs (same lanes, order and dependencies:
:func:`ipukit.schedules.ir.walk`) with costs instead of work, and returns a modeled
:class:`~ipukit.Timeline`. Costs may come from a measured timeline (:func:`costs_from`);
a calibrated table models a call with :func:`ipukit.timeline.costs.model_call`.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from itertools import repeat
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..schedules.build import build
from ..schedules.ir import (BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, Action, Schedule,
                            walk)
from .events import Event, KIND_NAMES, Timeline

Cost = Union[float, Sequence[float]]


@contextmanager
def _gc_paused():
    """Hold off the cyclic collector: tens of thousands of small tuples would trigger full
    collections over every object torch has created."""
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


def simulate(kind: str, num_stages: int, micro_batches: int, forward_cost: Cost = 1.0,
             backward_cost: Cost = 2.0, transfer_cost: float = 0.0, host_overhead: float = 0.0,
             step_cost: Cost = 0.0, iterations: int = 1, replicas: int = 1,
             stage_ipus: Optional[Sequence[int]] = None, samples: Optional[int] = None,
             schedule: Optional[Schedule] = None, weight_share: float = 0.5,
             input_grad_cost: Optional[Cost] = None,
             weight_grad_cost: Optional[Cost] = None,
             exposed_transfers: bool = False, cores: Optional[int] = None) -> Timeline:
    """Model one host call of a pipeline and return its (modeled) timeline.

    ``kind`` is any kind of :data:`ipukit.schedules.KINDS` (the modern ones on the placement
    they need unless ``stage_ipus`` says otherwise). ``micro_batches`` is the accumulation
    window (deviceIterations for inference), ``iterations`` the device iterations of a training
    call. Costs are seconds (or any unit) per micro-batch, scalars or one per stage;
    ``transfer_cost`` is added between stages on different IPUs, ``host_overhead`` once per
    call. A split backward costs ``(1 − weight_share) × backward`` for ``I`` and
    ``weight_share × backward`` for ``W`` unless ``input_grad_cost`` / ``weight_grad_cost``
    are given. ``exposed_transfers``: a send also occupies the sender, except DualPipeV's
    paired passes (:func:`paired_actions`); by default a transfer is latency only. ``cores``:
    at most that many passes at once (``None``: one core per worker).

    For equal stage costs and no overheads, GPipe's utilisation is exactly M / (M + N − 1).
    """
    N = int(num_stages)
    fwd = per_stage(forward_cost, N, "forward_cost")
    bwd = per_stage(backward_cost, N, "backward_cost")
    stp = per_stage(step_cost, N, "step_cost")
    with _gc_paused():
        if schedule is None:
            schedule = build(kind, N, micro_batches, iterations, stage_ipus)
        ipus = schedule.stage_ipus
        t_fwd = [transfer_cost if s > 0 and ipus[s - 1] != ipus[s] else 0.0 for s in range(N)]
        t_bwd = [transfer_cost if s < N - 1 and ipus[s + 1] != ipus[s] else 0.0 for s in range(N)]
        i_cost, w_cost = (None if c is None else per_stage(c, N, name) for c, name in (
            (input_grad_cost, "input_grad_cost"), (weight_grad_cost, "weight_grad_cost")))
        costs = split_costs(fwd, bwd, stp, weight_share, i_cost, w_cost)
        exposed = bool(exposed_transfers and transfer_cost)
        hidden = paired_actions(schedule.lanes) if exposed and schedule.kind == "dualpipev" else None
        times = walk(schedule.lanes, N, costs, {FORWARD: t_fwd, BACKWARD: t_bwd},
                     start_time=host_overhead, cores=cores, replicas=replicas,
                     exposed=exposed, hidden=hidden)
        events = []
        if host_overhead > 0:
            events.append(Event(-1, "host", -1, 0.0, host_overhead, -1, 0, 0, 0))
        for replica in range(replicas):
            for lane, lane_times in zip(schedule.lanes, times[replica]):
                events += lane_events(lane, lane_times, ipus, replica)
    meta = {"schedule": schedule.kind, "kind": schedule.kind, "num_stages": N,
            "micro_batches": micro_batches, "iterations": iterations, "replicas": replicas,
            "forward_cost": fwd, "backward_cost": bwd, "step_cost": stp,
            "transfer_cost": transfer_cost, "host_overhead": host_overhead,
            "exposed_transfers": bool(exposed_transfers), "cores": cores}
    if samples is not None:
        meta["samples"] = samples
    return Timeline(events, modeled=True, meta=meta)


def lane_events(lane: Sequence[Action], lane_times: Sequence[Tuple[float, float]],
                ipus: Sequence[int], replica: int, call: int = 0) -> List[Event]:
    """A lane's actions at their modeled times, as events (built column by column: fast)."""
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

def host_spans(measured: Timeline) -> Tuple[float, float]:
    """Host time before the first and after the last device event of a measured call."""
    device = measured.device_events()
    if not device:
        return 0.0, 0.0
    first, last = min(e.start for e in device), max(e.end for e in device)
    host = [e for e in measured.events if e.ipu < 0]
    return (sum(e.duration for e in host if e.end <= first),
            sum(e.duration for e in host if e.start >= last))


def paired_actions(lanes: List[List[Action]]) -> set:
    """The ``(lane, index)`` of both actions of DualPipeV's overlapped pairs: a forward, then
    a full backward of the lane's other stage (torch's ``OVERLAP_F_B``)."""
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


def available_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``), as the executor counts them."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
