"""The modern pipeline schedules, generated as data: one function per kind.

Each generator returns the lanes of one iteration (``M`` micro-batches) of a
:class:`~ipukit.schedules.Schedule`, in torch.distributed.pipelining's notation;
:func:`ipukit.schedules.build` repeats them, adds the optimiser steps and validates the
result, so every schedule is proven deadlock-free before anything runs it.

* ``interleaved-1f1b`` (``"Interleaved1F1B"``): v stages per IPU placed in a loop (stage s
  on IPU s mod P), one forward and one backward after the warm-up, in rounds of P;
* ``looped-bfs`` (``"LoopedBFS"``): the same placement, breadth first;
* ``zb-h1`` (``"ZBH1"``): 1F1B with each backward split into ``I`` and ``W``; IPU r defers
  r W's into the drain;
* ``zbv`` (``"ZBV"``): two stages per IPU in a V (IPU i holds stages i and 2P−1−i), W's
  fill the bubble;
* ``dualpipev`` (``"DualPipeV"``): DeepSeek's DualPipe cut to a V, forwards of one stage
  paired with backwards of the other.

The orders follow the published constructions and torch's classes of the same names
(``tests/test_schedules.py`` compares them with torch's action lists); ipukit writes
torch's ``OVERLAP_F_B`` pair as the forward, then the backward.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque
from typing import Dict, List, Optional, Sequence, Tuple

from .ir import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, ScheduleError
from .registry import LOOPED, PIPELINED_KINDS, SPLIT_BACKWARD, V_SHAPED  # noqa: F401

Op = Tuple[str, int, int]  # (kind, stage, micro-batch)

# -- placement --------------------------------------------------------------------------------

def placement(kind: str, num_stages: int, num_ipus: Optional[int] = None) -> List[int]:
    """The virtual IPU of each stage that ``kind`` wants (``num_ipus`` defaults sensibly).

    Looped kinds put stage s on IPU s mod P (default P = N / 2); V-shaped kinds put
    stages i and 2P−1−i on IPU i (P = N / 2); the others one stage per IPU.
    """
    N = int(num_stages)
    if kind in LOOPED:
        P = int(num_ipus) if num_ipus else max(1, N // 2)
        if N % P:
            raise ScheduleError(f"schedule {PIPELINED_KINDS[kind]!r} places stages in a loop over "
                                f"the IPUs: {N} stages do not divide evenly over {P} IPUs")
        return [s % P for s in range(N)]
    if kind in V_SHAPED:
        if N % 2 or (num_ipus and int(num_ipus) * 2 != N):
            raise ScheduleError(f"schedule {PIPELINED_KINDS[kind]!r} needs two stages per IPU in "
                                f"a V: an even number of stages, N = 2 × IPUs (got {N} stages"
                                + (f" on {num_ipus} IPUs)" if num_ipus else ")"))
        P = N // 2
        return [s if s < P else 2 * P - 1 - s for s in range(N)]
    return list(range(N))


def check_placement(kind: str, stage_ipus: Sequence[int],
                    names: Optional[Sequence[str]] = None) -> int:
    """Raise a :class:`ScheduleError` naming the placement ``kind`` needs; return the IPU count.

    ``names`` (a block of each stage) make the suggested ``PipelinedExecution`` the user's.
    """
    ipus = sorted(set(stage_ipus))
    P, N = len(ipus), len(stage_ipus)
    if kind not in LOOPED + V_SHAPED:
        return P
    dense = [ipus.index(i) for i in stage_ipus]
    wanted = placement(kind, N, P if kind in LOOPED else None)
    if dense != wanted:
        title = PIPELINED_KINDS[kind]
        rule = ("stage s on IPU s mod P (a loop)" if kind in LOOPED
                else "IPU i holds stages i and 2P−1−i (a V)")
        names = list(names) if names else [f"B{s + 1}" for s in range(N)]
        example = ", ".join(f'Stage("{names[s]}").ipu({i})' for s, i in enumerate(wanted))
        raise ScheduleError(
            f"pipelineSchedule({title!r}) needs the placement {rule}: stage IPUs {wanted} for "
            f"{N} stages on {max(wanted) + 1} IPUs, got {list(stage_ipus)}. Place the stages so, "
            f"e.g. PipelinedExecution({example}), or choose another schedule.")
    if kind in LOOPED and N == P:
        raise ScheduleError(f"pipelineSchedule({PIPELINED_KINDS[kind]!r}) needs several stages "
                            f"per IPU (stage s on IPU s mod P); with one stage per IPU use '1F1B'")
    return P


def minimum_micro_batches(kind: str, num_stages: int, num_ipus: int) -> int:
    """The fewest micro-batches (gradientAccumulation) ``kind`` runs with.

    GPipe and 1F1B keep PopTorch's 2N − 1; the others torch's: one per IPU (two for
    DualPipeV).
    """
    if kind in ("gpipe", "1f1b"):
        return 2 * num_stages - 1
    if kind == "dualpipev":
        return 2 * num_ipus
    return num_ipus


# -- the generators: one iteration, per IPU -------------------------------------------------

def _counted(ops: List[Tuple[str, int]]) -> List[Op]:
    """Number each (kind, stage) occurrence: its k-th forward is micro-batch k."""
    count: Dict[Tuple[str, int], int] = defaultdict(int)
    out = []
    for kind, stage in ops:
        out.append((kind, stage, count[(kind, stage)]))
        count[(kind, stage)] += 1
    return out


def interleaved_1f1b(rank: int, P: int, v: int, M: int) -> List[Op]:
    """Depth first over v local stages: warm up, then one forward and one backward.

    Micro-batches go in rounds of ``M // rounds`` (``rounds = max(1, M // P)``),
    as torch relaxes Megatron's M % P == 0 to M % rounds == 0.
    """
    rounds = max(1, M // P)
    if M % rounds:
        raise ScheduleError(f"pipelineSchedule('Interleaved1F1B') runs micro-batches in rounds "
                            f"of about {P}: gradientAccumulation {M} must be a multiple of "
                            f"{rounds} (e.g. {rounds * (M // rounds)} or {rounds * (M // rounds + 1)})")
    per_round, total = M // rounds, v * M
    warmup = min((v - 1) * per_round + 2 * (P - 1 - rank), total)
    ops: List[Tuple[str, int]] = []
    for k in range(total + warmup):
        if k < total:
            ops.append((FORWARD, ((k // per_round) % v) * P + rank))
        if k >= warmup:
            ops.append((BACKWARD, (v - 1 - ((k - warmup) // per_round) % v) * P + rank))
    return _counted(ops)


def looped_bfs(rank: int, P: int, v: int, M: int) -> List[Op]:
    """Breadth first: every micro-batch through one local stage before the next."""
    stages = [j * P + rank for j in range(v)]
    ops = [(FORWARD, s, m) for s in stages for m in range(M)]
    ops += [(BACKWARD, s, m) for s in reversed(stages) for m in reversed(range(M))]
    return ops


def zb_h1(rank: int, P: int, M: int) -> List[Op]:
    """1F1B with split backwards; the r-th IPU starts its W's r micro-batches late.

    Activations are held from a forward to its W: P micro-batches on every IPU, the
    most 1F1B holds on any.
    """
    warmup = min(P - 1 - rank, M)
    ops: List[Tuple[str, int]] = [(FORWARD, rank)] * warmup
    for k in range(M):
        if warmup + k < M:
            ops.append((FORWARD, rank))
        ops.append((INPUT_GRAD, rank))
        if k >= rank:
            ops.append((WEIGHT_GRAD, rank))
    ops += [(WEIGHT_GRAD, rank)] * min(rank, M)
    return _counted(ops)


def zbv(rank: int, P: int, M: int) -> List[Op]:
    """ZB-V (Qi et al., section 6): warm up down the V, then F-I-W on both stages.

    Built for max(M, 2P − 1) micro-batches and cut back to M, as torch does.
    """
    n = max(2 * P - 1, M)
    first, second = rank, 2 * P - 1 - rank
    ops: List[Tuple[str, int]] = [(FORWARD, first)] * (2 * (P - rank) - 1)
    ops += [(FORWARD, second), (FORWARD, first)] * rank
    ops += [(FORWARD, second), (INPUT_GRAD, second), (WEIGHT_GRAD, second)] * (P - rank)
    f = {first: 2 * (P - rank) - 1 + rank, second: P}
    while f[second] < f[first] or f[first] < n:
        if f[first] < n:
            ops.append((FORWARD, first))
            f[first] += 1
        ops += [(INPUT_GRAD, first), (WEIGHT_GRAD, first), (FORWARD, second),
                (INPUT_GRAD, second), (WEIGHT_GRAD, second)]
        f[second] += 1
    ops += [(INPUT_GRAD, first), (INPUT_GRAD, second)] * rank
    ops += [(INPUT_GRAD, first), (WEIGHT_GRAD, first)] * (P - rank)
    done = Counter(ops)
    ops += [(WEIGHT_GRAD, second)] * (done[(INPUT_GRAD, second)] - done[(WEIGHT_GRAD, second)])
    ops += [(WEIGHT_GRAD, first)] * (done[(INPUT_GRAD, first)] - done[(WEIGHT_GRAD, first)])
    return [op for op in _counted(ops) if op[2] < M]


def dualpipev(rank: int, P: int, M: int) -> List[Op]:
    """DualPipeV's eight phases (DeepSeek): a V, forwards paired with backwards.

    A backward is a full ``B`` until the drain (phase 6), then an ``I`` whose ``W`` is
    queued to fill phases 7 and 8.
    """
    first, second = rank, 2 * P - 1 - rank
    ops: List[Op] = []
    fwd: Dict[int, int] = defaultdict(int)
    bwd: Dict[int, int] = defaultdict(int)
    weights: deque = deque()

    def forward(stage: int) -> None:
        ops.append((FORWARD, stage, fwd[stage]))
        fwd[stage] += 1

    def backward(stage: int, split: bool) -> None:
        m = bwd[stage]
        bwd[stage] += 1
        ops.append((INPUT_GRAD if split else BACKWARD, stage, m))
        if split:
            weights.append((stage, m))

    def pending_weight() -> None:
        if weights:
            stage, m = weights.popleft()
            ops.append((WEIGHT_GRAD, stage, m))

    for _ in range(2 * (P - rank - 1)):
        forward(first)
    for _ in range(rank + 1):
        forward(first)
        forward(second)
    for _ in range(P - rank - 1):
        backward(second, True)
        pending_weight()
        forward(second)
    for _ in range(M - 2 * P + rank + 1):  # the main phase: F0 with B1, then F1 with B0
        forward(first)
        backward(second, False)
        forward(second)
        backward(first, False)
    for _ in range(P - rank - 1):
        backward(second, False)
        forward(second)
        backward(first, False)
    split, half = False, (rank + 1) // 2
    for i in range(rank + 1):
        split = split or (i == half and rank % 2 == 1)
        backward(second, split)
        split = split or (i == half and rank % 2 == 0)
        backward(first, split)
    for _ in range(P - rank - 1):
        pending_weight()
        backward(first, split)
    while weights:
        pending_weight()
    return ops


def lanes_for(kind: str, num_stages: int, micro_batches: int,
              stage_ipus: Sequence[int]) -> List[List[Op]]:
    """One iteration of ``kind``, one list per virtual IPU (sorted), placement checked."""
    N, M = int(num_stages), int(micro_batches)
    P = check_placement(kind, stage_ipus)
    if kind in LOOPED:
        v = N // P
        make = interleaved_1f1b if kind == "interleaved-1f1b" else looped_bfs
        return [make(r, P, v, M) for r in range(P)]
    if kind == "zbv":
        return [zbv(r, P, M) for r in range(P)]
    if kind == "dualpipev":
        if M < 2 * P:
            raise ScheduleError(f"pipelineSchedule('DualPipeV') needs at least two micro-batches "
                                f"per stage pair: gradientAccumulation {M} < {2 * P} "
                                f"(2 × {P} IPUs). Set gradientAccumulation to {2 * P} or more.")
        return [dualpipev(r, P, M) for r in range(P)]
    if kind == "zb-h1":
        return [zb_h1(s, N, M) for s in range(N)]  # per stage; build() merges shared IPUs
    raise ScheduleError(f"not a generated schedule kind: {kind!r}")
