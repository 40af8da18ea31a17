"""A machine's cost table, and a call modeled from it (pure data: nothing is run here).

:func:`ipukit.calibrate` measures the table, each part alone; :func:`model_call` turns it
into the modeled timeline of any schedule over any split of the blocks (:func:`ipukit.simulate`
is the same walk with costs you give).

The model includes every pass at its blocks' cost plus ``per_pass``, a ``handoff`` wherever a
tensor crosses workers, at most ``cores`` passes at once (:func:`ipukit.schedules.ir.walk`), one
``step`` per iteration and the host's work around the call. It leaves out contention beyond the
core count, slower passes after a wait and cooled caches: on a CPU a pipelined call usually
takes longer than modeled, and its figures say so, as they say the table's ``uncertain``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional, Sequence

from ..schedules.build import build
from ..schedules.ir import BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, walk
from .events import Event, Timeline
from .kinds import KIND_NAMES

#: what a modeled call with workers running at once says under its figure
CONCURRENT_NOTE = ("modeled: passes at their calibrated costs, at most {cores} at once; "
                   "contention beyond the core count and slower passes after a wait are "
                   "left out, so a pipelined call on a CPU usually measures slower")

#: the one sentence said under every figure drawn from a table marked uncertain
UNCERTAIN_NOTE = "uncertain calibration: {reasons}; re-run ipukit.calibrate on a quieter machine"


@dataclass
class CostTable:
    """What each part of a call costs on one machine and device, in seconds (per field below)."""

    blocks: List[str]
    forward: List[float]                  #: per block, one micro-batch
    backward: List[float]                 #: per block (a full backward)
    per_pass: float = 0.0                 #: fixed cost of one action
    handoff: float = 0.0                  #: one hand-off between workers
    step: float = 0.0                     #: one optimiser step of the whole model
    host_before: float = 0.0              #: a call's set-up before its first pass
    host_after: float = 0.0               #: a call's gathering after its last pass
    cores: int = 1                        #: passes that can run at once
    threads: int = 1                      #: intra-op threads the blocks were timed with
    weight_share: float = 0.5             #: a split backward's W share of B, if unmeasured
    device: str = "cpu"
    micro_batch: int = 0                  #: the micro-batch size the table was measured at
    #: per block, a split backward's input-gradient half (``I``); None: unmeasured
    input_grad: Optional[List[float]] = None
    #: per block, its weight-gradient half (``W``); None: unmeasured
    weight_grad: Optional[List[float]] = None
    #: what the calibration could not settle (a busy machine, rounds that disagreed, an
    #: implausible part), one phrase each; empty: none
    uncertain: List[str] = field(default_factory=list)
    notes: Dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostTable":
        """A table from :meth:`to_dict`'s dict; unknown parts (an older ipukit's) are dropped."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def stage_costs(self, stage_blocks: Sequence[Sequence[str]],
                    chained: bool = False) -> Dict[str, List[float]]:
        """Per stage, each pass kind's cost: its blocks' sum plus ``per_pass``.

        ``chained``: a call run as a plain loop (:class:`ipukit.runtime.fused.Chain`) pays no
        ``per_pass``. With measured halves, the stage that takes the data has ``I`` its first
        block's alone and ``W`` a full backward."""
        index = {b: i for i, b in enumerate(self.blocks)}
        missing = [b for names in stage_blocks for b in names if b not in index]
        if missing:
            raise ValueError(f"stage_costs: blocks {missing} are not in the table "
                             f"(it has {self.blocks})")
        fixed = 0.0 if chained else self.per_pass

        def total(values: Sequence[float], names: Sequence[str]) -> float:
            return sum(values[index[b]] for b in names) + fixed

        out = {"forward": [total(self.forward, n) for n in stage_blocks],
               "backward": [total(self.backward, n) for n in stage_blocks]}
        if self.input_grad and self.weight_grad:
            first = self.blocks[0] if self.blocks else None
            takes_data = [bool(n) and n[0] == first for n in stage_blocks]
            out["input-grad"] = [total(self.input_grad, n[:1] if d else n)
                                 for n, d in zip(stage_blocks, takes_data)]
            out["weight-grad"] = [b if d else total(self.weight_grad, n) for n, d, b in
                                  zip(stage_blocks, takes_data, out["backward"])]
        return out


def even_split(blocks: Sequence[str], stages: int) -> List[List[str]]:
    """``blocks`` cut into ``stages`` contiguous runs, as evenly by count as they go."""
    n = len(blocks)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} stages")
    edges = [round(i * n / stages) for i in range(stages + 1)]
    return [list(blocks[edges[i]:edges[i + 1]]) for i in range(stages)]


def model_call(table: CostTable, kind: str, stage_blocks: Sequence[Sequence[str]],
               micro_batches: int, iterations: int = 1, replicas: int = 1,
               stage_ipus: Optional[Sequence[int]] = None, samples: Optional[int] = None,
               cores: Optional[int] = None) -> Timeline:
    """The modeled timeline of one call: ``kind`` over ``stage_blocks``, from ``table``.

    ``cores`` defaults to the table's; ``stage_ipus`` to the schedule's placement.
    """
    N = len(stage_blocks)
    schedule = build(kind, N, micro_batches, iterations if "inference" not in kind else 1,
                     stage_ipus)
    ipus = list(schedule.stage_ipus)
    workers = len(schedule.lanes) * replicas
    training = schedule.training
    chained = (training and not schedule.split_backward and replicas == 1
               and (schedule.sequential or workers == 1) and schedule.chained)
    c = table.stage_costs(stage_blocks, chained=chained)
    fwd = c["forward"]
    bwd = c["backward"] if training else [0.0] * N
    # one host step per iteration, shared by the stages of a lane
    step = [table.step / k if training else 0.0 for k in schedule.stages_in_lane]
    fixed = 0.0 if chained else table.per_pass
    if "input-grad" in c:
        i_cost, w_cost = c["input-grad"], c["weight-grad"]
    else:    # unmeasured halves: B split by weight_share (the first stage's W is all of B)
        share = [1.0 if s == 0 else table.weight_share for s in range(N)]
        i_cost = [(b - fixed) * (1 - w) + fixed for b, w in zip(bwd, share)]
        w_cost = [(b - fixed) * w + fixed for b, w in zip(bwd, share)]
    costs = {FORWARD: fwd, BACKWARD: bwd, STEP: step, INPUT_GRAD: i_cost, WEIGHT_GRAD: w_cost}
    # a hand-off is one worker waking another
    lane_of = schedule.lane_of_stage
    crosses = [s > 0 and lane_of[s - 1] != lane_of[s] for s in range(N)]
    transfers = {FORWARD: [table.handoff if crosses[s] else 0.0 for s in range(N)],
                 BACKWARD: [table.handoff if s < N - 1 and crosses[s + 1] else 0.0
                            for s in range(N)]}
    limit = int(cores if cores is not None else table.cores)
    limit = limit if limit < workers else None      # enough cores: nothing to wait for
    before = table.host_before
    times = walk(schedule.lanes, N, costs, transfers, before, cores=limit, replicas=replicas)
    notes: List[str] = []
    if workers > 1 and "sharded" not in schedule.kind:
        notes.append(CONCURRENT_NOTE.format(cores=min(workers, int(cores or table.cores))))
    if training and schedule.split_backward and "input-grad" not in c:
        notes.append(f"split backward modeled as {1 - table.weight_share:.0%} / "
                     f"{table.weight_share:.0%} of a full backward (I and W not measured)")
    if table.uncertain:
        notes.append(UNCERTAIN_NOTE.format(reasons="; ".join(table.uncertain)))

    def span_start(k: str, s: int, a: float, b: float) -> float:
        # a pass's fixed cost is measured as the idle gap before it: the span leaves it out
        cost = costs[k][s]
        if k == STEP or cost <= 0 or fixed <= 0:
            return a
        return a + (b - a) * min(1.0, fixed / cost)

    events: List[Event] = []
    if before > 0:
        events.append(Event(-1, "host", -1, 0.0, before, -1, 0, 0, 0))
    for replica in range(replicas):
        for lane, lane_times in zip(schedule.lanes, times[replica]):
            events += [Event(s, KIND_NAMES[k], m, span_start(k, s, a, b), b, ipus[s], replica, it, 0)
                       for (k, s, m, it), (a, b) in zip(lane, lane_times)]
    end = max((e.end for e in events), default=before)
    if table.host_after > 0:
        events.append(Event(-1, "host", -1, end, end + table.host_after, -1, 0,
                            schedule.iterations - 1, 0))
    meta = {"schedule": schedule.kind, "num_stages": N, "micro_batches": micro_batches,
            "iterations": schedule.iterations, "replicas": replicas, "stage_ipus": ipus,
            "stage_blocks": [list(b) for b in stage_blocks], "calibrated": True,
            "cores": limit, "threads": table.threads, "per_pass": table.per_pass,
            "handoff": table.handoff, "uncertain": list(table.uncertain), "notes": notes}
    if samples is not None:
        meta["samples"] = samples
    return Timeline(events, modeled=True, meta=meta)


def agreement(measured: Timeline, modeled: Timeline) -> str:
    """One sentence: measured ÷ modeled time per call, and the likeliest reason where they
    differ by more than a tenth."""
    if modeled.wall_time <= 0 or measured.wall_time <= 0:
        return "measured ÷ modeled: nothing to compare"
    r = measured.time_per_call() / modeled.time_per_call()
    said = f"measured ÷ modeled: {r:.2f}"
    if abs(r - 1) <= 0.10:
        return said + " — the calibrated costs held for this call"
    if modeled.meta.get("uncertain"):
        why = "the calibration was marked uncertain"
    elif r < 1:
        why = "the machine ran faster than when it was calibrated"
    elif any(n.startswith("modeled: passes") for n in modeled.meta.get("notes", ())):
        why = "passes running at once slowed each other more than the core count alone says"
    else:
        why = "the machine ran slower than when it was calibrated (other work on it?)"
    return f"{said} — the call took {abs(r - 1):.0%} {'longer' if r > 1 else 'less'} than " \
        f"modeled: {why}"
