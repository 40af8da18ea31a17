"""A pipeline schedule as data: an ordered list of actions per worker lane.

One :class:`Schedule` feeds the executor, the simulator and the plots, so a measured and a
modeled timeline can differ only in *when* something ran, never in *what* ran *where*.
Actions use torch.distributed.pipelining's notation, ``"{stage}{kind}{micro_batch}"``
(``"2F0"``, ``"2B0"``, the split backward's ``"2I0"``/``"2W0"``); ipukit adds ``"2S"``, the
optimiser step that ends an iteration (:meth:`Schedule.to_torch` leaves steps out). The
schedule's rules live in :func:`walk`, the one dependency walk the simulator, the lane order
of stages sharing an IPU and :meth:`Schedule.validate` use. Kinds here: ``"gpipe"``,
``"1f1b"``, ``"sharded"``, ``"inference"`` and ``"sharded-inference"`` (the modern ones are
in :mod:`ipukit.schedules.generators`). It imports nothing else from ipukit.
"""
from __future__ import annotations

import heapq
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .registry import KINDS, PIPELINED_KINDS, kind_of  # noqa: F401  (the IR's vocabulary)

FORWARD, BACKWARD, STEP = "F", "B", "S"
INPUT_GRAD, WEIGHT_GRAD = "I", "W"
ACTION_KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, STEP)
_ACTION = re.compile(r"^\s*(\d+)([FBIWS])(\d*)\s*$")


class ScheduleError(ValueError):
    """A schedule that cannot run: a malformed action, a missing or repeated one, a deadlock."""


class Action(NamedTuple):
    """One unit of work: a forward, a backward (full, input- or weight-gradient), or a step."""

    kind: str
    stage: int
    micro_batch: int = -1
    iteration: int = 0

    def __str__(self) -> str:
        if self.kind == STEP:
            return f"{self.stage}S"
        return f"{self.stage}{self.kind}{self.micro_batch}"

    @staticmethod
    def from_str(text: str, iteration: int = 0) -> "Action":
        """Parse ``"{stage}{kind}{micro_batch}"`` (``"1F3"``, ``"0S"``); the inverse of ``str``."""
        match = _ACTION.match(str(text))
        if match is None:
            raise ScheduleError(f"action {text!r}: write actions as '{{stage}}{{kind}}"
                                f"{{micro_batch}}' with kind one of {list(ACTION_KINDS)}, "
                                "e.g. '2F0' (stage 2, forward, micro-batch 0) or '2S' (its step)")
        stage, kind, micro = match.groups()
        if (kind == STEP) != (micro == ""):
            raise ScheduleError(f"action {text!r}: a step has no micro-batch ('{stage}S'), "
                                f"every other action has one (e.g. '{stage}{kind}0')")
        return Action(kind, int(stage), int(micro) if micro else -1, iteration)


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

    def __post_init__(self) -> None:
        self._by_iteration: Optional[List[List[List[Action]]]] = None

    @property
    def training(self) -> bool:
        return "inference" not in self.kind

    @cached_property
    def split_backward(self) -> bool:
        """Whether some backward runs as separate input- and weight-gradient actions."""
        return any(a.kind == INPUT_GRAD for lane in self.lanes for a in lane)

    @property
    def sequential(self) -> bool:
        return self.kind.startswith("sharded")

    @cached_property
    def lane_of_stage(self) -> List[Optional[int]]:
        """Per stage, the lane (one worker) that runs it; None for a stage no lane runs."""
        out: List[Optional[int]] = [None] * self.num_stages
        for li, lane in enumerate(self.lanes):
            for a in lane:
                if out[a.stage] is None:
                    out[a.stage] = li
        return out

    @cached_property
    def stages_in_lane(self) -> List[int]:
        """Per stage, how many stages its lane runs (its step actions share one host step)."""
        lanes = self.lane_of_stage
        return [max(1, lanes.count(li)) if li is not None else 1 for li in lanes]

    @cached_property
    def chained(self) -> bool:
        """Whether one lane runs each micro-batch whole (forwards, backwards) before the next."""
        n = self.num_stages
        if len(self.lanes) != 1 or not n:
            return False
        for it in range(self.iterations):
            lane = self.iteration_lanes(it)[0]
            if len(lane) % (2 * n):
                return False
            for first in range(0, len(lane), 2 * n):
                mb = lane[first].micro_batch
                if lane[first:first + 2 * n] != \
                        [Action(FORWARD, s, mb, it) for s in range(n)] + \
                        [Action(BACKWARD, s, mb, it) for s in reversed(range(n))]:
                    return False
        return True

    def actions(self) -> List[Action]:
        return [a for lane in self.lanes for a in lane]

    def iteration_lanes(self, iteration: int, with_steps: bool = False) -> List[List[Action]]:
        """The lanes' actions of one iteration (optimiser steps left out by default)."""
        if with_steps:
            return [[a for a in lane if a.iteration == iteration] for lane in self.lanes]
        if self._by_iteration is None:
            by = [[[] for _ in self.lanes] for _ in range(self.iterations)]
            for li, lane in enumerate(self.lanes):
                for a in lane:
                    if a.kind != STEP:
                        by[a.iteration][li].append(a)
            self._by_iteration = by
        return self._by_iteration[iteration]

    def to_strings(self) -> List[List[str]]:
        """The schedule in torch.distributed.pipelining's notation, one list per lane."""
        return [[str(a) for a in lane] for lane in self.lanes]

    @classmethod
    def from_strings(cls, kind: str, lanes: Sequence[Sequence[str]], num_stages: int,
                     micro_batches: int, stage_ipus: Optional[Sequence[int]] = None,
                     lane_ipus: Optional[Sequence[Optional[int]]] = None) -> "Schedule":
        """Read :meth:`to_strings`' output back: an action's *k*-th occurrence in its lane
        belongs to iteration *k*, so a round trip is exact."""
        parsed, iterations = [], 1
        for lane in lanes:
            count: Dict[str, int] = {}
            out = []
            for text in lane:
                a = Action.from_str(text)
                it = count.get(str(a), 0)
                count[str(a)] = it + 1
                out.append(a._replace(iteration=it))
                iterations = max(iterations, it + 1)
            parsed.append(out)
        ipus = list(stage_ipus) if stage_ipus is not None else list(range(num_stages))
        lane_list = list(lane_ipus) if lane_ipus is not None else (
            [None] if len(parsed) == 1 and num_stages > 1 else sorted(set(ipus)))
        schedule = cls(kind, num_stages, micro_batches, iterations, ipus, parsed, lane_list)
        schedule.validate()
        return schedule

    def to_torch(self, iteration: int = 0) -> Dict[int, list]:
        """One iteration as torch.distributed.pipelining ``_Action`` lists, one per lane (rank).

        Steps are left out: torch's caller steps the optimiser after ``step()``.
        """
        from .._torch import torch_action

        return {rank: [torch_action(str(a)) for a in lane]
                for rank, lane in enumerate(self.iteration_lanes(iteration))}

    @classmethod
    def from_torch(cls, kind: str, pipeline_order: Dict[int, list], num_stages: int,
                   micro_batches: int, stage_ipus: Optional[Sequence[int]] = None,
                   training: bool = True) -> "Schedule":
        """An ipukit schedule (one iteration, steps appended) from torch's per-rank actions.

        Communication and resharding actions (``SEND_F``, ``UNSHARD``, ...) and empty
        slots are dropped.
        """
        lanes = []
        for rank in sorted(pipeline_order):
            lane = [str(a) for a in pipeline_order[rank]
                    if a is not None and a.computation_type.value in ACTION_KINDS]
            if training:
                stages = sorted({Action.from_str(t).stage for t in lane})
                lane += [f"{s}S" for s in stages]
            lanes.append(lane)
        ipus = list(stage_ipus) if stage_ipus is not None else [0] * num_stages
        if stage_ipus is None:
            for rank, lane in enumerate(lanes):
                for text in lane:
                    ipus[Action.from_str(text).stage] = rank
        return cls.from_strings(kind, lanes, num_stages, micro_batches, ipus,
                                lane_ipus=list(range(len(lanes))))

    def validate(self) -> "Schedule":
        """Check the schedule can run: every action once, backward after forward, no deadlock.

        Training: one ``B`` or one ``I`` and one ``W`` per forward, one step per stage
        and iteration. The dependency walk then proves the lanes cannot deadlock.
        """
        N, M = self.num_stages, self.micro_batches
        seen: Dict[tuple, int] = {}
        for lane in self.lanes:
            for a in lane:
                if not 0 <= a.stage < N:
                    raise ScheduleError(f"action {a}: stage {a.stage} is not in 0..{N - 1}")
                if a.kind != STEP and not 0 <= a.micro_batch < M:
                    raise ScheduleError(f"action {a}: micro-batch {a.micro_batch} is not in "
                                        f"0..{M - 1}")
                key = (a.kind, a.stage, a.micro_batch, a.iteration)
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > 1:
                    raise ScheduleError(f"action {a} (iteration {a.iteration}) appears twice")
        wanted = [FORWARD] + ([BACKWARD] if self.training else [])
        for it in range(self.iterations):
            for s in range(N):
                if self.training and (STEP, s, -1, it) not in seen:
                    raise ScheduleError(f"stage {s} has no step '{s}S' in iteration {it}")
                for m in range(M):
                    for kind in wanted:
                        if (kind, s, m, it) in seen:
                            continue
                        if kind == BACKWARD and (INPUT_GRAD, s, m, it) in seen \
                                and (WEIGHT_GRAD, s, m, it) in seen:
                            continue
                        raise ScheduleError(f"action '{s}{kind}{m}' of iteration {it} is missing")
        self._check_lane_order()
        walk(self.lanes, N, {k: [1.0] * N for k in ACTION_KINDS})
        return self

    def _check_lane_order(self) -> None:
        """A backward before its own forward (or W before its I) in one lane waits forever."""
        needs = {BACKWARD: (FORWARD, "its forward"), INPUT_GRAD: (FORWARD, "its forward"),
                 WEIGHT_GRAD: (INPUT_GRAD, "its input gradient")}
        for li, lane in enumerate(self.lanes):
            where = {a: i for i, a in enumerate(lane)}
            for i, a in enumerate(lane):
                if a.kind not in needs:
                    continue
                kind, words = needs[a.kind]
                first = a._replace(kind=kind)
                if where.get(first, -1) > i:
                    raise ScheduleError(
                        f"schedule deadlocks: action {a} comes before {words} {first} in lane "
                        f"{li} (iteration {a.iteration}), so lane {li} would wait for itself "
                        f"forever: move {a} after {first}")

    def describe(self) -> Dict[str, object]:
        return {"kind": self.kind, "num_stages": self.num_stages,
                "micro_batches": self.micro_batches, "iterations": self.iterations,
                "stage_ipus": list(self.stage_ipus)}


# -- the rules: which action waits for which ------------------------------------------------

def walk(lanes: Sequence[Sequence[Action]], num_stages: int, costs: Dict[str, Sequence[float]],
         transfers: Optional[Dict[str, Sequence[float]]] = None, start_time: float = 0.0,
         cores: Optional[int] = None, replicas: int = 1, exposed: bool = False,
         hidden: Optional[set] = None) -> List[List[List[Tuple[float, float]]]]:
    """Time every action of ``lanes``; returns ``times[replica][lane]`` = [(start, end), ...].

    The rules of a pipeline, in one place: each lane runs its actions in order; a forward waits
    for the previous stage's forward of the micro-batch (plus ``transfers["F"][stage]``); a
    backward or ``I`` waits for its own forward and the next stage's gradient (plus
    ``transfers["B"][stage]``); ``W`` waits for its ``I``; an optimiser step waits for the
    iteration's flush. ``costs[kind][stage]`` is an action's duration (``I`` and ``W`` default
    to half of ``B``). ``cores`` limits how many passes run at once (earliest ready first; steps
    take no core). A transfer is latency only unless ``exposed`` (the sender is busy too, except
    the actions in ``hidden``). Lanes that wait on each other forever raise
    :class:`ScheduleError`, naming which lane waits for which action.
    """
    N, last = num_stages, num_stages - 1
    zero = [0.0] * N
    transfers = transfers or {}
    t_fwd, t_bwd = transfers.get(FORWARD, zero), transfers.get(BACKWARD, zero)
    half = [c / 2 for c in costs.get(BACKWARD, zero)]
    cost = {FORWARD: costs[FORWARD], BACKWARD: costs.get(BACKWARD, zero),
            INPUT_GRAD: costs.get(INPUT_GRAD, half), WEIGHT_GRAD: costs.get(WEIGHT_GRAD, half),
            STEP: costs.get(STEP, zero)}
    limited = cores is not None
    if limited and cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    hidden = hidden or set()
    copies = replicas if limited else 1       # free cores: every replica runs alike
    workers = [(r, li) for r in range(copies) for li in range(len(lanes))]
    n_iter, width = 1, 1
    counted: Counter = Counter()   # passes per iteration (steps wait for them, not counted)
    for lane in lanes:
        if lane:
            kinds, _, mbs, its = zip(*lane)
            n_iter, width = max(n_iter, max(its) + 1), max(width, max(mbs) + 1)
            counted.update(compress(its, map(STEP.__ne__, kinds)))
    remaining: Dict[int, int] = {it: c * copies for it, c in counted.items()}
    flush_end = [start_time] * n_iter
    flushed: List[Optional[float]] = [None] * n_iter
    # by (replica, stage, iteration * width + micro-batch): a forward's end, and when its
    # activation (or a B/I's gradient) reaches the stage that needs it
    size = n_iter * width
    own, sent, grad, igrad = ([[[None] * size for _ in range(N)] for _ in range(copies)]
                              for _ in range(4))     # grad: B or I
    waiting: Dict[tuple, List[int]] = {}    # dependency -> workers waiting on it
    wants: Dict[int, tuple] = {}            # worker -> the dependency it waits on
    times = [[[] for _ in lanes] for _ in range(copies)]
    pos = [0] * len(workers)
    free = [start_time] * len(workers)
    ready: list = []   # (ready time, worker): a heap under limited cores, else a stack
    push = heapq.heappush if limited else list.append
    core_free = [start_time] * cores if limited else None

    def send(kind: str, s: int) -> float:
        if kind == FORWARD:
            return t_fwd[s + 1] if s < last else 0.0
        if kind in (BACKWARD, INPUT_GRAD):
            return t_bwd[s - 1] if s > 0 else 0.0
        return 0.0

    def dependency(w: int) -> Optional[float]:
        """When worker ``w``'s next action may start, or None (and registered) if not yet known."""
        r, li = workers[w]
        kind, s, m, it = lanes[li][pos[w]]
        k = it * width + m
        if kind == STEP:
            dep, key = flushed[it], ("S", it)
        elif kind == FORWARD:
            if s == 0:
                return free[w]
            dep, key = sent[r][s - 1][k], ("F", r, s - 1, k)
        elif kind == WEIGHT_GRAD:
            dep, key = igrad[r][s][k], ("I", r, s, k)
        else:  # B or I: the gradient from the next stage, and this stage's own forward
            mine = own[r][s][k]
            if mine is None:
                dep, key = None, ("F", r, s, k)
            elif s == last:
                dep, key = mine, None
            else:
                dep, key = grad[r][s + 1][k], ("G", r, s + 1, k)
                dep = None if dep is None else max(dep, mine)
        if dep is None:
            waiting.setdefault(key, []).append(w)
            wants[w] = key
            return None
        return dep if dep > free[w] else free[w]

    def queue(w: int) -> None:
        t = dependency(w)
        if t is not None:
            wants.pop(w, None)
            push(ready, (t, w))

    def wake(key: tuple) -> None:
        for w in waiting.pop(key, ()):
            queue(w)

    for w, (_, li) in enumerate(workers):
        if lanes[li]:
            queue(w)
    pop = heapq.heappop if limited else list.pop
    while ready:
        t, w = pop(ready)
        r, li = workers[w]
        lane = lanes[li]
        kind, s, m, it = lane[pos[w]]
        c = cost[kind][s]
        out = send(kind, s)
        if exposed and out and (li, pos[w]) not in hidden:
            c, out = c + out, 0.0      # the sender is busy sending; it arrives at the end
        if limited and kind != STEP:
            core = heapq.heappop(core_free)
            if core > t:
                t = core
            heapq.heappush(core_free, t + c)
        end = t + c
        times[r][li].append((t, end))
        pos[w] += 1
        free[w] = end
        if kind != STEP:
            k = it * width + m
            if kind == FORWARD:
                own[r][s][k] = end
                sent[r][s][k] = end + out
                wake(("F", r, s, k))
            elif kind != WEIGHT_GRAD:
                grad[r][s][k] = end + out
                wake(("G", r, s, k))
                if kind == INPUT_GRAD:
                    igrad[r][s][k] = end
                    wake(("I", r, s, k))
            if end > flush_end[it]:
                flush_end[it] = end
            remaining[it] -= 1
            if remaining[it] == 0:
                flushed[it] = flush_end[it]
                wake(("S", it))
        if pos[w] < len(lane):
            queue(w)
    stuck = [w for w, (_, li) in enumerate(workers) if pos[w] < len(lanes[li])]
    if stuck:
        raise ScheduleError(_deadlock(lanes, workers, pos, wants, stuck, width))
    return times if limited else times * replicas


def _deadlock(lanes, workers, pos, wants: Dict[int, tuple], stuck: List[int],
              width: int) -> str:
    """Which lane waits at which action for which other action, followed to a cycle."""
    home: Dict[tuple, int] = {}
    for li, lane in enumerate(lanes):
        for a in lane:
            home[(a.kind, a.stage, a.micro_batch, a.iteration)] = li
    lane_worker = {li: w for w, (r, li) in enumerate(workers) if r == 0}

    def needed(li: int) -> Optional[Action]:
        key = wants.get(lane_worker.get(li, -1))
        if key is None or key[0] == "S":
            return None
        tag, _, s, k = key
        it, m = divmod(k, width)
        if tag == "F":
            return Action(FORWARD, s, m, it)
        if tag == "I":
            return Action(INPUT_GRAD, s, m, it)
        nxt = Action(BACKWARD, s, m, it)          # "G": the next stage's B, or its I
        return nxt if tuple(nxt) in home else Action(INPUT_GRAD, s, m, it)

    names = [str(lanes[workers[w][1]][pos[w]]) for w in stuck]
    chain: List[int] = []
    li = next((workers[w][1] for w in stuck if needed(workers[w][1]) is not None), None)
    parts = []
    while li is not None and li not in chain:
        chain.append(li)
        want = needed(li)
        if want is None:
            break
        owner = home.get(tuple(want))
        parts.append(f"lane {li} waits at {lanes[li][pos[lane_worker[li]]]} for {want}"
                     + (f" (lane {owner})" if owner is not None else " (which no lane runs)"))
        li = owner
    if not parts:
        return f"schedule deadlocks: lanes wait at {names}"
    text = "schedule deadlocks: " + ", which ".join(
        p if i == 0 else p.split(" ", 2)[2] for i, p in enumerate(parts))
    if li is not None and li in chain:
        text += ": the lanes wait for each other in a cycle"
    return text + f" (lanes wait at {names}); reorder the lanes' actions so that what each " \
        "lane waits for can run first"
