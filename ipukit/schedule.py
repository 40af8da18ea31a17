"""A pipeline schedule as data: an ordered list of actions per worker lane.

One :class:`Schedule` feeds the executor (which runs it), the simulator (which
times it) and the plots (which draw it), so a measured and a modeled timeline
can differ only in *when* something ran, never in *what* ran *where*.

Actions use torch.distributed.pipelining's compact notation: ``"2F0"`` is the
forward of micro-batch 2 on stage 0, ``"2B0"`` its backward, ``"S0"`` the
optimiser step of stage 0 that ends an iteration.

Kinds:

* ``"gpipe"`` — every forward of the accumulation window, then every backward;
* ``"1f1b"`` — stage *s* runs N−1−s forwards, then alternates one forward and
  one backward (PopART's steady state), then drains the backwards;
* ``"sharded"`` — one micro-batch at a time through all stages, one lane;
* ``"inference"`` / ``"sharded-inference"`` — forwards only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

KINDS = ("gpipe", "1f1b", "sharded", "inference", "sharded-inference")
FORWARD, BACKWARD, STEP = "F", "B", "S"


class Action(NamedTuple):
    """One unit of work: a forward, a backward, or an optimiser step."""

    kind: str
    stage: int
    micro_batch: int = -1
    iteration: int = 0

    def __str__(self) -> str:
        if self.kind == STEP:
            return f"S{self.stage}"
        return f"{self.micro_batch}{self.kind}{self.stage}"


@dataclass
class Schedule:
    """Per-lane action lists for one model call.

    ``lanes[k]`` is executed in order by one worker; ``stage_ipus[s]`` is the
    virtual IPU of stage ``s``. Pipelined schedules have one lane per virtual
    IPU; sharded ones a single lane.
    """

    kind: str
    num_stages: int
    micro_batches: int
    iterations: int
    stage_ipus: List[int]
    lanes: List[List[Action]]
    lane_ipus: List[Optional[int]] = field(default_factory=list)

    @property
    def training(self) -> bool:
        return "inference" not in self.kind

    @property
    def sequential(self) -> bool:
        return self.kind.startswith("sharded")

    def actions(self) -> List[Action]:
        return [a for lane in self.lanes for a in lane]

    def iteration_lanes(self, iteration: int, with_steps: bool = False) -> List[List[Action]]:
        """The lanes' actions of one iteration (optimiser steps left out by default)."""
        return [[a for a in lane if a.iteration == iteration and (with_steps or a.kind != STEP)]
                for lane in self.lanes]

    def to_strings(self) -> List[List[str]]:
        """The schedule in torch.distributed.pipelining's notation, one list per lane."""
        return [[str(a) for a in lane] for lane in self.lanes]

    def describe(self) -> Dict[str, object]:
        return {"kind": self.kind, "num_stages": self.num_stages,
                "micro_batches": self.micro_batches, "iterations": self.iterations,
                "stage_ipus": list(self.stage_ipus)}


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
    """Build the schedule of a call: ``iterations`` × an accumulation window."""
    kind = kind.lower()
    if kind not in KINDS:
        raise ValueError(f"schedule kind {kind!r}: use one of {list(KINDS)}")
    N, M = int(num_stages), int(micro_batches)
    if N < 1 or M < 1 or iterations < 1:
        raise ValueError("num_stages, micro_batches and iterations must be >= 1")
    stage_ipus = list(stage_ipus) if stage_ipus is not None else list(range(N))
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
    per_stage = []
    new = tuple.__new__  # building tens of thousands of actions: skip NamedTuple.__new__
    for s in range(N):
        actions: List[Action] = []
        program = stage_program(kind, s, N, M)
        for it in range(iterations):
            actions += [new(Action, (k, s, m, it)) for k, m in program]
            if training:
                actions.append(Action(STEP, s, -1, it))
        per_stage.append(actions)
    ipus = sorted(set(stage_ipus))
    if len(ipus) == N and all(stage_ipus[s] == ipus[s] for s in range(N)):
        return Schedule(kind, N, M, iterations, stage_ipus, per_stage, ipus)
    return Schedule(kind, N, M, iterations, stage_ipus,
                    _merge_on_ipus(per_stage, stage_ipus, ipus), ipus)


def _merge_on_ipus(per_stage: List[List[Action]], stage_ipus: Sequence[int],
                   ipus: Sequence[int]) -> List[List[Action]]:
    """Stages that share an IPU share its lane, in the order a unit-time run gives.

    Sorting by the start times of a dependency-respecting run keeps every lane a
    sub-sequence of one topological order, so the merged lanes cannot deadlock.
    """
    from .simulate import play  # local: simulate builds on schedule

    N = len(per_stage)
    unit = [1.0] * N
    times = play(per_stage, N, {FORWARD: unit, BACKWARD: unit, STEP: unit})
    order = {FORWARD: 1, BACKWARD: 0, STEP: 2}
    lanes = []
    for ipu in ipus:
        merged = [(t[0], order[a.kind], a.stage, a) for s in range(N) if stage_ipus[s] == ipu
                  for a, t in zip(per_stage[s], times[s])]
        merged.sort(key=lambda x: x[:3])
        lanes.append([x[3] for x in merged])
    return lanes
