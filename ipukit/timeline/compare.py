"""Every pipeline schedule side by side, on the same IPUs and the same model (modeled).

Each IPU's part of the model costs ``forward_cost[i]`` / ``backward_cost[i]`` per
micro-batch; a schedule placing v stages on each IPU cuts it into v stages of 1/v the cost
and activations. :func:`compare_schedules` models one step of each kind with
:func:`ipukit.simulate`: its time, bubble and peak activations per IPU (in one IPU part's
micro-batch activations).

Given a calibrated :class:`~ipukit.timeline.costs.CostTable` (``table=``), each schedule is
modeled from an even partition of its blocks instead (unavailable with more stages than
blocks). ``communication="exposed"`` (default): a send occupies the sender, except in
DualPipeV's paired passes; ``"latency"``: latency only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

from ..schedules.ir import ScheduleError
from ..schedules.registry import PIPELINED_KINDS
from ..schedules.generators import LOOPED, V_SHAPED, minimum_micro_batches, placement
from .costs import CostTable, even_split
from .simulate import per_stage, simulate
from .events import BACKWARD_END_KINDS, COMPUTE_KINDS, Timeline

Cost = Union[float, Sequence[float]]
#: Stages per IPU that the comparison gives the schedules placing several there.
VIRTUAL_STAGES = 2


@dataclass
class ScheduleSummary:
    """One schedule's modeled step: time, bubble, memory (``available`` False: why not)."""

    kind: str
    name: str
    num_stages: int
    step_time: float = 0.0
    bubble: float = 0.0                       # idle share of the IPUs' time in the step
    peak_activations: List[float] = field(default_factory=list)   # per IPU
    timeline: Optional[Timeline] = None
    available: bool = True
    reason: str = ""
    modeled: bool = True
    ipus: int = 0                             # IPUs the schedule ran on
    ipu_time: float = 0.0                     # step_time × ipus: IPU-time per step
    stage_blocks: Optional[List[List[str]]] = None   # the partition (with a table)


def layout(kind: str, num_ipus: int, virtual_stages: int = VIRTUAL_STAGES) -> List[int]:
    """The stage → IPU placement the comparison gives ``kind`` on ``num_ipus`` IPUs."""
    if kind in LOOPED:
        return placement(kind, virtual_stages * num_ipus, num_ipus)
    if kind in V_SHAPED:
        return placement(kind, 2 * num_ipus)
    return list(range(num_ipus))


def peak_activations(timeline: Timeline, stage_ipus: Sequence[int]) -> List[float]:
    """Per IPU, the most activations held at once (replica 0), a stage weighing 1 / its IPU's
    stages."""
    P = max(stage_ipus) + 1
    share = [1.0 / stage_ipus.count(stage_ipus[s]) for s in range(len(stage_ipus))]
    marks: List[List[tuple]] = [[] for _ in range(P)]
    for e in timeline.events:
        if e.replica != 0 or e.stage < 0:
            continue
        if e.kind == "forward":
            marks[stage_ipus[e.stage]].append((e.start, share[e.stage]))
        elif e.kind in BACKWARD_END_KINDS:
            marks[stage_ipus[e.stage]].append((e.end, -share[e.stage]))
    out = []
    for ipu_marks in marks:
        level = peak = 0.0
        for _, delta in sorted(ipu_marks):   # at equal times, a release comes first
            level += delta
            peak = max(peak, level)
        out.append(round(peak, 9))
    return out


def bubble(timeline: Timeline, num_ipus: int) -> float:
    """The idle share of ``num_ipus`` IPUs between the step's first and last pass."""
    passes = [e for e in timeline.events if e.kind in COMPUTE_KINDS and e.replica == 0]
    if not passes:
        return 0.0
    span = max(e.end for e in passes) - min(e.start for e in passes)
    busy = sum(e.duration for e in passes)
    return max(0.0, 1.0 - busy / (num_ipus * span)) if span > 0 else 0.0


def summarize(kind: str, num_ipus: int, micro_batches: int, forward_cost: Cost = 1.0,
              backward_cost: Cost = 2.0, weight_share: float = 0.5,
              transfer_cost: Optional[float] = None, virtual_stages: int = VIRTUAL_STAGES,
              table: Optional[CostTable] = None, communication: str = "exposed"
              ) -> ScheduleSummary:
    """Model one step of ``kind`` on ``num_ipus`` IPUs (see the module docstring).

    With ``table``, ``transfer_cost`` defaults to its hand-off.
    """
    if communication not in ("exposed", "latency"):
        raise ValueError(f"communication must be 'exposed' or 'latency', got {communication!r}")
    P, M = int(num_ipus), int(micro_batches)
    ipus = layout(kind, P, virtual_stages)
    N = len(ipus)
    summary = ScheduleSummary(kind, PIPELINED_KINDS[kind], N, ipus=P)
    needed = 1 if kind in ("gpipe", "1f1b") else minimum_micro_batches(kind, N, P)
    if M < needed:
        summary.available, summary.reason = False, f"needs ≥ {needed} micro-batches"
        return summary
    if transfer_cost is None:
        transfer_cost = table.handoff if table is not None else 0.0
    split = {}
    if table is not None:
        if N > len(table.blocks):
            summary.available, summary.reason = False, (
                f"needs {N} stages on {P} IPUs; the network has {len(table.blocks)} blocks")
            return summary
        stages = even_split(table.blocks, N)
        c = table.stage_costs(stages)
        fwd_s, bwd_s = c["forward"], c["backward"]
        split = {"input_grad_cost": c.get("input-grad"), "weight_grad_cost": c.get("weight-grad")}
        if "input-grad" not in c:    # the first stage's W is its whole backward
            split = {"input_grad_cost": [0.0 if s == 0 else b * (1 - table.weight_share)
                                         for s, b in enumerate(bwd_s)],
                     "weight_grad_cost": [b if s == 0 else b * table.weight_share
                                          for s, b in enumerate(bwd_s)]}
        summary.stage_blocks = stages
    else:
        v = N // P
        fwd = per_stage(forward_cost, P, "forward_cost")
        bwd = per_stage(backward_cost, P, "backward_cost")
        fwd_s, bwd_s = [fwd[i] / v for i in ipus], [bwd[i] / v for i in ipus]
    try:
        tl = simulate(kind, N, M, fwd_s, bwd_s, transfer_cost=transfer_cost, stage_ipus=ipus,
                      weight_share=weight_share, exposed_transfers=communication == "exposed",
                      **split)
    except ScheduleError as exc:
        summary.available, summary.reason = False, str(exc)
        return summary
    tl.meta.update(stage_ipus=ipus, communication=communication)
    if table is not None:
        tl.meta.update(stage_blocks=summary.stage_blocks, calibrated=True)
    summary.timeline, summary.step_time = tl, tl.end - tl.start
    summary.ipu_time = summary.step_time * P
    summary.bubble, summary.peak_activations = bubble(tl, P), peak_activations(tl, ipus)
    return summary


def compare_schedules(num_ipus: int, micro_batches: int, forward_cost: Cost = 1.0,
                      backward_cost: Cost = 2.0, weight_share: float = 0.5,
                      kinds: Optional[Sequence[str]] = None,
                      transfer_cost: Optional[float] = None,
                      virtual_stages: int = VIRTUAL_STAGES, table: Optional[CostTable] = None,
                      communication: str = "exposed") -> Dict[str, ScheduleSummary]:
    """Every pipelined schedule (or ``kinds``) modeled by :func:`summarize` on the same IPUs
    (``virtual_stages``: stages per IPU of the looped kinds)."""
    kinds = list(PIPELINED_KINDS) if kinds is None else list(kinds)
    return {k: summarize(k, num_ipus, micro_batches, forward_cost, backward_cost,
                         weight_share, transfer_cost, virtual_stages, table=table,
                         communication=communication) for k in kinds}
