"""Building a call's schedule: a kind's lanes repeated over device iterations, with the
optimiser steps, merged onto IPUs and validated (the modern kinds' orders come from
:mod:`.generators`, their placements from :mod:`.registry`)."""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

from .generators import lanes_for, placement
from .ir import (BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, Action, Schedule, walk)
from .registry import KINDS, PIPELINED_KINDS, kind_of


def stage_program(kind: str, stage: int, num_stages: int, micro_batches: int) -> List[Tuple[str, int]]:
    """The (kind, micro-batch) sequence one pipelined stage runs in an iteration."""
    M, N = micro_batches, num_stages
    if kind == "inference":
        return [(FORWARD, m) for m in range(M)]
    if kind == "gpipe":
        return [(FORWARD, m) for m in range(M)] + [(BACKWARD, m) for m in range(M)]
    if kind == "1f1b":
        warmup = min(N - 1 - stage, M)
        program = [(FORWARD, m) for m in range(warmup)]
        for k in range(M - warmup):
            program += [(FORWARD, warmup + k), (BACKWARD, k)]
        program += [(BACKWARD, m) for m in range(M - warmup, M)]
        return program
    raise ValueError(f"not a pipelined kind: {kind!r}")


def build(kind: str, num_stages: int, micro_batches: int, iterations: int = 1,
          stage_ipus: Optional[Sequence[int]] = None) -> Schedule:
    """Build the schedule of a call: ``iterations`` × an accumulation window.

    ``kind`` is one of :data:`KINDS` (or a name :func:`kind_of` reads); the
    modern kinds come from :mod:`ipukit.schedules`, which checks the placement
    they need. Every built schedule with a generated order is validated.
    Schedules are never changed once built, so the last few are kept: a
    dashboard models the same schedule with new costs at every slider move.
    """
    ipus = tuple(int(i) for i in stage_ipus) if stage_ipus is not None else None
    return _build(kind, num_stages, micro_batches, iterations, ipus)


@lru_cache(maxsize=32)
def _build(kind: str, num_stages: int, micro_batches: int, iterations: int,
           stage_ipus: Optional[Tuple[int, ...]]) -> Schedule:
    name = kind
    kind = kind_of(kind) or str(kind).lower()
    if kind not in KINDS:
        raise ValueError(f"schedule kind {name!r}: use one of {list(KINDS)}")
    N, M = int(num_stages), int(micro_batches)
    if N < 1 or M < 1 or iterations < 1:
        raise ValueError("num_stages, micro_batches and iterations must be >= 1")
    stage_ipus = list(stage_ipus) if stage_ipus is not None else None
    if stage_ipus is None:
        stage_ipus = placement(kind, N) if kind in PIPELINED_KINDS else list(range(N))
    training = "inference" not in kind
    if kind.startswith("sharded"):
        lane: List[Action] = []
        for it in range(iterations):
            for m in range(M):
                lane += [Action(FORWARD, s, m, it) for s in range(N)]
                if training:
                    lane += [Action(BACKWARD, s, m, it) for s in reversed(range(N))]
            if training:
                lane += [Action(STEP, s, -1, it) for s in range(N)]
        return Schedule(kind, N, M, iterations, stage_ipus, [lane], [None])
    ipus = sorted(set(stage_ipus))
    new = tuple.__new__  # building tens of thousands of actions: skip NamedTuple.__new__
    if kind in ("gpipe", "1f1b", "inference", "zb-h1"):
        if kind == "zb-h1":
            programs = [[(k, m) for k, _, m in ops] for ops in lanes_for(kind, N, M, stage_ipus)]
        else:
            programs = [stage_program(kind, s, N, M) for s in range(N)]
        per_stage = []
        for s in range(N):
            actions: List[Action] = []
            for it in range(iterations):
                actions += [new(Action, (k, s, m, it)) for k, m in programs[s]]
                if training:
                    actions.append(Action(STEP, s, -1, it))
            per_stage.append(actions)
        if len(ipus) == N and all(stage_ipus[s] == ipus[s] for s in range(N)):
            return Schedule(kind, N, M, iterations, stage_ipus, per_stage, ipus)
        return Schedule(kind, N, M, iterations, stage_ipus,
                        _merge_on_ipus(per_stage, stage_ipus, ipus), ipus).validate()
    lanes = []
    for ops in lanes_for(kind, N, M, stage_ipus):
        stages = sorted({s for _, s, _ in ops})
        lane = []
        for it in range(iterations):
            lane += [new(Action, (k, s, m, it)) for k, s, m in ops]
            lane += [Action(STEP, s, -1, it) for s in stages]
        lanes.append(lane)
    return Schedule(kind, N, M, iterations, stage_ipus, lanes, ipus).validate()


def _merge_on_ipus(per_stage: List[List[Action]], stage_ipus: Sequence[int],
                   ipus: Sequence[int]) -> List[List[Action]]:
    """Stages that share an IPU share its lane, in the order a unit-time run gives.

    Sorting by the start times of a dependency-respecting run keeps every lane a
    sub-sequence of one topological order, so the merged lanes cannot deadlock.
    """
    N = len(per_stage)
    unit = [1.0] * N
    times = walk(per_stage, N, {FORWARD: unit, BACKWARD: unit, STEP: unit})[0]
    order = {FORWARD: 1, INPUT_GRAD: 0, BACKWARD: 0, WEIGHT_GRAD: 0, STEP: 2}
    lanes = []
    for ipu in ipus:
        merged = [(t[0], order[a.kind], a.stage, a) for s in range(N) if stage_ipus[s] == ipu
                  for a, t in zip(per_stage[s], times[s])]
        merged.sort(key=lambda x: x[:3])
        lanes.append([x[3] for x in merged])
    return lanes
