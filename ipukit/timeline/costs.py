"""A machine's cost table, and a call modeled from it (pure data: nothing is run here).

:func:`ipukit.calibrate` measures the table on the learner's machine, each part in
isolation; :func:`model_call` turns it into the modeled timeline of any schedule over
any split of the blocks. The model is the one :func:`ipukit.simulate` walks, with the
costs a real call pays on top of the blocks' compute:

- every pass (forward, backward, or a split backward's half) costs its blocks' compute
  plus ``per_pass``, the fixed cost of running one action (ipukit's bookkeeping and the
  stage module's call), measured as the idle gap between passes and drawn as one: a
  modeled pass's span starts after its share of ``per_pass``, as a measured span does;
- a stage's backward is one gradient call over its blocks, each timed as a call of its
  own: it pays ``grad_call`` (a call's fixed cost) once, not once per block;
- a backward (or ``W``) action that is its stage's own gradient call also pays, after its
  span, the release of what its blocks held for the micro-batch (``release``, each
  block's measured in the one-worker run: the gap after its backward beyond
  ``per_pass``); drawn, like ``per_pass``, before the span;
- where one worker runs every stage (a sharded call), one gradient call per micro-batch
  runs every stage's backward; a sharded training call of one replica runs as a plain
  loop does (the executor's chain), whose passes pay no ``per_pass``;
- an activation or gradient that crosses to another worker costs ``handoff`` (a
  worker waking another); stages one worker runs (a sharded call's, several on one
  IPU) hand over for free;
- a split backward's halves cost their blocks' measured ``input_grad`` and
  ``weight_grad`` (the stage that takes the data has no input gradient: its ``W`` is a
  full backward of its blocks); unmeasured, ``weight_share`` of a full backward; a ``W``
  makes a gradient call per parameter group, and each walks the graph below its start:
  in a stage of several blocks, each block's calls also walk the blocks before it
  (``graph_walk``, ``weight_calls``);
- a call whose workers run at once costs its blocks as measured on a worker thread
  (``on_worker``: a worker gets fewer intra-op threads than the calling thread, which
  times the blocks for one-worker calls);
- while k passes of different workers run at once, each advances at
  ``concurrency[k − 1] / k`` of its speed alone (:func:`~ipukit.timeline.simulate.play_shared`):
  the calibrated rate of k concurrent passes on worker threads, which holds the cores,
  the interpreter lock a pass holds for its Python side, and the slowdown of more
  workers than cores; with more workers than cores on a CPU the executor pins worker i
  to core i mod the cores, and the model shares each core only among the passes pinned
  to it (:func:`~ipukit.timeline.simulate.pinned_slots`);
  without it, at most ``cores`` passes run at once (workers beyond the cores wait);
- passes that hold the interpreter lock (``lock_share``, measured per block beside a
  twin) also wait for each other's: a pass of share g beside passes of shares g_j runs
  1 + g × Σ g_j slower (the whole-model rate above corrected for its own share);
- a ``W`` hands the interpreter lock over between its gradient calls (one per parameter
  group, ``weight_calls``): each call beyond the first costs every other worker then
  running a pass one ``handoff`` (a wake-up), spread over the ``W``'s span
  (:meth:`CostTable.stage_weight_calls`; measured in pairs on 2 CPU cores: the ViT's
  first stage beside a second stage running F, I and W took 1.14-1.54× as long as beside
  the same stage running F and B, waiting for the lock 38-42 times a step against 15);
- each optimiser step costs ``step`` on the host, once per iteration, after the flush;
- a call pays ``host_before`` (splitting the inputs, the undo copy) and ``host_after``
  (gathering the outputs) around its passes, and a training call the undo copy of its
  optimiser's state (``state_copy``) before them.

What the model leaves out is said where it is drawn (``Timeline.meta["notes"]``, shown
under :func:`ipukit.viz.plots.compare_figure`): contention is an average rate — which
worker the interpreter lock and the operating system favour at each moment, and caches
warmed by a neighbouring pass, are not modeled. A modeled figure is labelled
``modeled`` (``Timeline.modeled``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from ..schedules.build import build
from ..schedules.ir import BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, walk
from .events import Event, Timeline
from .simulate import pinned_slots, play_shared
from .kinds import KIND_NAMES

#: what the model says under a call with more worker threads than cores (CPU). Fair sharing
#: is an average: the operating system runs a ready worker only at a time slice's end now
#: and then, and the critical path pays for those waits (each thread's run-queue time,
#: read from ``/proc/thread-self/schedstat``: 6-11 ms a call per light stage of the
#: convnet's 1F1B on 4 IPUs, waits of 2-4 ms on its critical path). Measured, not modeled
#: (``benchmarks/calibration.md``, 2-core VM, the workers pinned and modeled so):
#: such calls ran up to 45 % slower than modeled (model ÷ measured 0.69-0.99 over five
#: runs; the convnet's 0.69-0.96, the ViT's 0.89-0.99)
OVERSUBSCRIBED_NOTE = ("; with more workers than cores a ready worker now and then waits for "
                       "a time slice, which an average leaves out: such calls measured up to "
                       "45 % slower than modeled on a 2-core machine "
                       "(benchmarks/calibration.md)")

IN_TURN_NOTE = ("; which of a core's workers runs is the OS's choice: Linux shared a core "
                "in slices in one process and ran its workers' passes in turn in the next, "
                "so each IPU's busy share is modeled as a range, from passes run in turn "
                "to slices (busy_range; benchmarks/busy_spread.py)")

WAITED_NOTE = ("a pass is modeled at its cost back to back, as the calibration times it; "
               "where a worker waited for its neighbour first, the pass ran 1.1-1.35× "
               "slower on the 2-core VM ipukit is measured on (a core that idled, a tensor "
               "made on another core: benchmarks/cross_core.md), which such calls' model "
               "leaves out")


HELD_NOTE = ("a pass that runs while other micro-batches' activations are held on its worker "
             "is modeled at the calibrated stretch of such passes ({f:.2f}× a forward, "
             "{b:.2f}× a backward), each stage's passes at their mean")


@dataclass
class CostTable:
    """What each part of a call costs on one machine and device, in seconds."""

    blocks: List[str]
    forward: List[float]                  #: per block, one micro-batch, alone
    backward: List[float]                 #: per block (a full backward)
    per_pass: float = 0.0                 #: fixed cost of one action
    handoff: float = 0.0                  #: one hand-off between workers
    step: float = 0.0                     #: one optimiser step of the whole model
    host_before: float = 0.0              #: a call's set-up before its first pass
    host_after: float = 0.0               #: a call's gathering after its last pass
    cores: int = 1                        #: passes that can run at once
    weight_share: float = 0.5             #: a split backward's weight half, share of B
    device: str = "cpu"
    micro_batch: int = 0                  #: the micro-batch size the table was measured at
    notes: Dict[str, str] = field(default_factory=dict)
    #: per block, a split backward's input-gradient half (``I``), measured alone; None:
    #: ``(1 − weight_share) × backward``
    input_grad: Optional[List[float]] = None
    #: per block, its weight-gradient half (``W``, with the gradient accumulation); None:
    #: ``weight_share × backward``
    weight_grad: Optional[List[float]] = None
    #: the work rate of k passes running at once on worker threads (k = 1, 2, ...; the
    #: first is 1): what k workers really get from the cores (their count, the interpreter
    #: lock, the scheduler). None: k passes get min(k, cores)
    concurrency: Optional[List[float]] = None
    #: the blocks' costs measured again on a worker thread, with the intra-op threads the
    #: executor gives a worker of a pipeline ("forward", "backward", "input_grad",
    #: "weight_grad", per block), where those differ from the calling thread's (which
    #: times the fields above and runs one-worker calls); None: the same
    on_worker: Optional[Dict[str, Optional[List[float]]]] = None
    #: per pass kind ("forward", "backward", "input_grad", "weight_grad"), each block's
    #: share of its pass's time holding the interpreter lock (measured beside a twin:
    #: :func:`ipukit.balance.lock_share`); None: not measured (passes that run at once
    #: slow each other only at the calibrated rate of k whole-model passes)
    lock_share: Optional[Dict[str, List[float]]] = None
    #: per block, seconds the autograd engine takes to walk its graph once
    #: (:func:`ipukit.balance.graph_walk`). A split backward's ``W`` makes a separate
    #: gradient call per parameter group (``weight_calls``), and each walks the whole
    #: graph below its start: in a stage of several blocks, each block's calls also walk
    #: the blocks before it in the stage. None: a stage's ``W`` is its blocks' sum
    graph_walk: Optional[List[float]] = None
    #: per block, the separate gradient calls its ``W`` makes (see ``graph_walk``)
    weight_calls: Optional[List[int]] = None
    #: seconds of a gradient call's fixed cost (a call on a one-node graph:
    #: :func:`ipukit.balance.gradient_call`). Each block's backward is timed as a call of
    #: its own; a stage's backward is one call over its blocks, and a sharded call's one
    #: call over the whole model per micro-batch, so they pay it fewer times than their
    #: blocks' sum. 0: not measured
    grad_call: float = 0.0
    #: seconds a training call's undo copy spends on the optimiser's state, before its
    #: passes (the blocks' run that gives ``host_before`` has none: added to it)
    state_copy: float = 0.0
    #: per block, seconds a backward action spends after its span releasing what the block
    #: held for that micro-batch (its graph and activations, freed as the action returns),
    #: beyond ``per_pass``: the gap after the block's backward in the one-worker run, less
    #: ``per_pass``. A stage's backward (or ``W``) pays its blocks' sum where each stage's
    #: backward is its own gradient call (measured on 2 cores: the ViT's 6-block first
    #: stage spent 210 µs a backward after its span, its one-block stages 60-80 µs). None:
    #: not measured (``per_pass`` alone)
    release: Optional[List[float]] = None
    #: per pass kind ("forward", "backward"), how many times slower a pass runs while other
    #: micro-batches' activations are held on its stage (:func:`ipukit.calibrate.held_stretch`:
    #: the blocks are timed one micro-batch at a time). None: not measured (every pass at
    #: its cost one at a time)
    held: Optional[Dict[str, float]] = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostTable":
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def mean(cls, tables: Sequence["CostTable"]) -> "CostTable":
        """The tables' mean, cost by cost (each number, each list's and each dict's entries):
        tables of one model calibrated at different moments, e.g. before and after the calls
        they predict, on a machine whose speed moves between them. Counts (``cores``,
        ``micro_batch``, ``weight_calls``), the device and the notes are the first table's; a
        part that any table lacks (None) is left out."""
        if not tables:
            raise ValueError("CostTable.mean: no tables")
        first = tables[0]
        if any(t.blocks != first.blocks for t in tables):
            raise ValueError("CostTable.mean: the tables time different blocks")

        def avg(values):
            if any(v is None for v in values):
                return None
            v0 = values[0]
            if isinstance(v0, bool):
                return v0
            if isinstance(v0, (int, float)):
                return sum(values) / len(values)
            if isinstance(v0, list):
                if any(len(v) != len(v0) for v in values):
                    return v0
                return [avg([v[i] for v in values]) for i in range(len(v0))]
            if isinstance(v0, dict):
                return {k: avg([v.get(k) for v in values]) for k in v0}
            return v0

        data = [t.to_dict() for t in tables]
        kept = ("blocks", "cores", "device", "micro_batch", "notes", "weight_calls")
        return cls(**{k: (v if k in kept else avg([d[k] for d in data]))
                      for k, v in data[0].items()})

    def stage_costs(self, stage_blocks: Sequence[Sequence[str]],
                    on_worker: bool = False, fused: bool = False,
                    chained: bool = False) -> Dict[str, List[float]]:
        """Per stage: forward and backward compute (the blocks' sums) plus the pass cost.

        A stage's backward (and input-gradient half) is one gradient call over its blocks,
        each timed as a call of its own: ``grad_call`` less for each block beyond the first.

        ``on_worker``: the blocks' costs on a pipeline's worker thread (:attr:`on_worker`,
        where measured), for a call whose workers run at once. ``fused``: one gradient
        call per micro-batch runs every stage's backward (the last stage's holds its fixed
        cost), as the executor's :class:`~ipukit.runtime.fused.FusedBackward` does where one
        worker runs every stage. ``chained`` (fused too): a call that runs as a plain loop
        does (:class:`ipukit.runtime.fused.Chain`), whose passes pay no ``per_pass``."""
        fused = fused or chained
        if on_worker and self.on_worker:
            worker = self.on_worker
            table = CostTable(**dict(self.to_dict(), on_worker=None,
                                     forward=worker["forward"], backward=worker["backward"],
                                     input_grad=worker.get("input_grad"),
                                     weight_grad=worker.get("weight_grad")))
            return table.stage_costs(stage_blocks, fused=fused, chained=chained)
        index = {b: i for i, b in enumerate(self.blocks)}
        missing = [b for names in stage_blocks for b in names if b not in index]
        if missing:
            raise ValueError(f"stage_costs: blocks {missing} are not in the table "
                             f"(it has {self.blocks})")
        per_pass = 0.0 if chained else self.per_pass
        last = len(stage_blocks) - 1

        def calls_saved(s: int, names: Sequence[str]) -> float:
            # the calls a stage's one backward call (a fused one per micro-batch) saves
            # against its blocks' own
            own = 1 if (not fused or s == last) else 0
            return max(0, len(names) - own) * self.grad_call

        fwd = [sum(self.forward[index[b]] for b in names) + per_pass
               for names in stage_blocks]
        # a stage's own gradient call frees its blocks' graphs as its action returns; a
        # fused one (one worker) frees them all in the one call, as the blocks' run did
        freed = [0.0] * len(stage_blocks) if fused else self.stage_release(stage_blocks)
        bwd = [max(0.0, sum(self.backward[index[b]] for b in names) - calls_saved(s, names))
               + per_pass + freed[s] for s, names in enumerate(stage_blocks)]
        out = {"forward": fwd, "backward": bwd}
        if self.input_grad and self.weight_grad:
            # the stage that takes the data needs no input gradient: its W is a full
            # backward of its blocks (ipukit's W back-propagates from the stage's outputs)
            first = self.blocks[0] if self.blocks else None
            # the first stage's I is its first block's pass alone; a later stage's I is one
            # call over its blocks; W's calls add up (one per parameter group, each block's)
            out["input-grad"] = [
                (self.input_grad[index[names[0]]] if names and names[0] == first
                 else max(0.0, sum(self.input_grad[index[b]] for b in names)
                          - max(0, len(names) - 1) * self.grad_call)) + per_pass
                for names in stage_blocks]
            out["weight-grad"] = [
                bwd[s] if names and names[0] == first          # a full backward
                else (sum(self.weight_grad[index[b]] for b in names) + self.walks_below(names)
                      + per_pass + freed[s])
                for s, names in enumerate(stage_blocks)]
        return out

    def stage_release(self, stage_blocks: Sequence[Sequence[str]]) -> List[float]:
        """Per stage, what its backward (or ``W``) action spends releasing its blocks'
        graphs and activations after its span: the blocks' :attr:`release` summed (0 where
        the table has none)."""
        if not self.release:
            return [0.0] * len(stage_blocks)
        index = {b: i for i, b in enumerate(self.blocks)}
        return [sum(self.release[index[b]] for b in names) for names in stage_blocks]

    def walks_below(self, names: Sequence[str]) -> float:
        """What a ``W`` of the stage of blocks ``names`` pays beyond its blocks' own: each
        block's gradient calls (``weight_calls``) walk the graphs of the blocks before it
        in the stage (``graph_walk``). 0 where the table has no walks."""
        if not self.graph_walk or not self.weight_calls:
            return 0.0
        index = {b: i for i, b in enumerate(self.blocks)}
        total, below = 0.0, 0.0
        for b in names:
            total += self.weight_calls[index[b]] * below
            below += self.graph_walk[index[b]]
        return total


    def stage_weight_calls(self, stage_blocks: Sequence[Sequence[str]]) -> Optional[List[int]]:
        """Per stage, the gradient calls its ``W`` makes: its blocks' ``weight_calls``
        summed; 1 for the stage that takes the data (its ``W`` is one full backward). None
        where the table has no calls."""
        if not self.weight_calls:
            return None
        index = {b: i for i, b in enumerate(self.blocks)}
        first = self.blocks[0] if self.blocks else None
        return [1 if names and names[0] == first
                else sum(self.weight_calls[index[b]] for b in names)
                for names in stage_blocks]

    def stage_lock_shares(self, stage_blocks: Sequence[Sequence[str]],
                          on_worker: bool = False) -> Optional[Dict[str, List[float]]]:
        """Per stage and pass kind (the keys of :meth:`stage_costs`): the share of the
        pass's time holding the interpreter lock — its blocks' measured shares weighted by
        their costs, and the pass's fixed cost (ipukit's bookkeeping, Python) at 1. None
        where the table has none (:attr:`lock_share`)."""
        if not self.lock_share:
            return None
        worker = self.on_worker if on_worker and self.on_worker else {}
        index = {b: i for i, b in enumerate(self.blocks)}
        first = self.blocks[0] if self.blocks else None
        measured = {"forward": worker.get("forward") or self.forward,
                    "backward": worker.get("backward") or self.backward,
                    "input_grad": worker.get("input_grad") or self.input_grad,
                    "weight_grad": worker.get("weight_grad") or self.weight_grad}

        def mix(kind: str, names: Sequence[str]) -> float:
            costs = measured.get(kind) or measured["backward"]
            shares = self.lock_share.get(kind) or self.lock_share.get("backward") or []
            if not shares:
                return 0.0
            held = sum(shares[index[b]] * costs[index[b]] for b in names) + self.per_pass
            total = sum(costs[index[b]] for b in names) + self.per_pass
            return min(1.0, held / total) if total > 0 else 0.0

        out = {"forward": [mix("forward", n) for n in stage_blocks],
               "backward": [mix("backward", n) for n in stage_blocks]}
        # the first stage's halves: I of its first block alone, W a full backward
        out["input-grad"] = [mix("input_grad", n[:1] if n and n[0] == first else n)
                             for n in stage_blocks]
        out["weight-grad"] = [mix("backward" if n and n[0] == first else "weight_grad", n)
                              for n in stage_blocks]
        return out

    def whole_lock_share(self) -> float:
        """The interpreter-lock share of a whole-model forward and backward (the passes
        :attr:`concurrency` times), its blocks' shares weighted by their costs."""
        if not self.lock_share:
            return 0.0
        f, b = self.lock_share.get("forward") or [], self.lock_share.get("backward") or []
        if len(f) != len(self.forward) or len(b) != len(self.backward):
            return 0.0
        total = sum(self.forward) + sum(self.backward)
        held = sum(g * c for g, c in zip(f, self.forward)) + \
            sum(g * c for g, c in zip(b, self.backward))
        return held / total if total > 0 else 0.0


def even_split(blocks: Sequence[str], stages: int) -> List[List[str]]:
    """``blocks`` cut into ``stages`` contiguous runs, as evenly by count as they go."""
    n = len(blocks)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} stages")
    edges = [round(i * n / stages) for i in range(stages + 1)]
    return [list(blocks[edges[i]:edges[i + 1]]) for i in range(stages)]


def held_shares(lanes, num_stages: int) -> Dict[str, List[float]]:
    """Per pass kind and stage, the share of the stage's passes that run while other
    activations are held on its worker: a forward after forwards (of any of the worker's
    stages) whose backwards have not run, a backward (or ``I``, or ``W``) while another is
    held besides its own. A stage's micro-batch is held from its forward to its last
    backward action (its ``B``, or its ``W``); the count starts afresh each iteration. Read
    off the lanes' order alone: a worker runs its lane's passes in that order."""
    deep = {k: [0] * num_stages for k in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)}
    total = {k: [0] * num_stages for k in deep}
    for lane in lanes:
        held: Dict[int, int] = {}
        for kind, s, _m, it in lane:
            if kind not in deep:
                continue
            key = it
            here = held.get(key, 0)
            others = here if kind == FORWARD else here - 1
            total[kind][s] += 1
            deep[kind][s] += others > 0
            if kind == FORWARD:
                held[key] = here + 1
            elif kind in (BACKWARD, WEIGHT_GRAD):
                held[key] = here - 1
    return {k: [d / t if t else 0.0 for d, t in zip(deep[k], total[k])] for k in deep}


def _with_held(costs: Dict[str, List[float]], held: Dict[str, float],
               shares: Dict[str, List[float]], pass_cost: float) -> Dict[str, List[float]]:
    """Each stage's pass costs with the held stretch of :attr:`CostTable.held` for the
    share of its passes that run with other micro-batches held (the pass's fixed cost,
    ipukit's bookkeeping, is not stretched): a stage's passes are modeled at their mean."""
    out = dict(costs)
    for kind, by in ((FORWARD, "forward"), (BACKWARD, "backward"),
                     (INPUT_GRAD, "backward"), (WEIGHT_GRAD, "backward")):
        f = held.get(by, 1.0)
        out[kind] = [pass_cost + max(0.0, c - pass_cost) * (1 + (f - 1) * share)
                     for c, share in zip(costs[kind], shares[kind])]
    return out


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
    concurrent = workers > 1 and "sharded" not in schedule.kind   # sharded: one at a time
    training = schedule.training
    # one worker for every stage (a sharded call, or a pipeline on one lane) runs one
    # backward per micro-batch over all stages (the executor's FusedBackward), and a
    # chained call of one replica as a plain loop (its Chain; anchors or half-precision
    # weights keep it on the action path, which the model does not know of)
    fused = (training and not schedule.split_backward
             and (schedule.sequential or workers == 1))
    chained = fused and replicas == 1 and schedule.chained
    c = table.stage_costs(stage_blocks, on_worker=concurrent, fused=fused, chained=chained)
    pass_cost = 0.0 if chained else table.per_pass
    freed = [0.0] * N if fused else table.stage_release(stage_blocks)
    fwd = c["forward"]
    bwd = c["backward"] if training else [0.0] * N
    lane_of = schedule.lane_of_stage
    # the executor steps once on the host for every stage, while the workers wait: each
    # lane's step actions (they run side by side) add up to one step. A sharded call's one
    # lane holds every stage: charging each of them a whole step modeled a sharded ViT on
    # 4 IPUs 3 steps (27 ms of ~300) slower per iteration than on one
    step = [table.step / k if training else 0.0 for k in schedule.stages_in_lane]
    if "input-grad" in c:      # measured halves (calibrate times I and W of every block)
        i_cost, w_cost = c["input-grad"], c["weight-grad"]
    else:
        # a split backward: I then W, B split by weight_share. The first stage's inputs
        # are the data, which need no gradient: its I computes nothing (only the pass),
        # its W is the whole backward (measured: 0.01 ms of I against 2.65 ms of W for
        # the convnet's first stage)
        share = [1.0 if s == 0 else table.weight_share for s in range(N)]
        # (the release after a backward is W's: I keeps what W needs)
        i_cost = [(b - table.per_pass - f) * (1 - w) + table.per_pass
                  for b, w, f in zip(bwd, share, freed)]
        w_cost = [(b - table.per_pass - f) * w + table.per_pass + f
                  for b, w, f in zip(bwd, share, freed)]
    costs = {FORWARD: fwd, BACKWARD: bwd, STEP: step, INPUT_GRAD: i_cost, WEIGHT_GRAD: w_cost}
    notes: List[str] = []
    if table.held and training and not fused:
        costs = _with_held(costs, table.held, held_shares(schedule.lanes, N), pass_cost)
        notes.append(HELD_NOTE.format(f=table.held.get("forward", 1.0),
                                      b=table.held.get("backward", 1.0)))
    # a hand-off is one worker waking another: stages a single worker runs in turn (a
    # sharded call's, or a looped schedule's on one IPU) pass their tensors straight on
    crosses = [s > 0 and lane_of[s - 1] != lane_of[s] for s in range(N)]
    transfers = {FORWARD: [table.handoff if crosses[s] else 0.0 for s in range(N)],
                 BACKWARD: [table.handoff if s < N - 1 and crosses[s + 1] else 0.0
                            for s in range(N)]}
    before = table.host_before + (table.state_copy if training else 0.0)
    start = before
    in_turn = None
    if cores is None and table.concurrency and concurrent:
        # k passes at once share the CPU at the calibrated rate of k concurrent passes
        limit = None
        lock = table.stage_lock_shares(stage_blocks, on_worker=concurrent)
        if lock is not None:
            lock = {FORWARD: lock["forward"], BACKWARD: lock["backward"],
                    INPUT_GRAD: lock["input-grad"], WEIGHT_GRAD: lock["weight-grad"]}
        # the executor pins workers that outnumber the cores: each core is shared by its own
        pinned = (pinned_slots(workers, table.cores) if table.device.startswith("cpu")
                  else None)
        # a W's gradient calls hand the interpreter lock over to a waiting neighbour: each
        # call beyond the first costs the other running workers a hand-off (a wake-up)
        calls = table.stage_weight_calls(stage_blocks)
        handovers = None
        if calls and training and any(WEIGHT_GRAD == a[0] for lane in schedule.lanes
                                      for a in lane):
            handovers = {WEIGHT_GRAD: [(n - 1) * table.handoff / w if w > 0 else 0.0
                                       for n, w in zip(calls, w_cost)]}
        times = play_shared(schedule.lanes, N, costs, transfers, start,
                            parallelism=table.concurrency, replicas=replicas,
                            lock=lock, lock_whole=table.whole_lock_share(), pinned=pinned,
                            handovers=handovers)
        if pinned:   # the other end of what the OS does with a core's workers: in turn
            in_turn = play_shared(schedule.lanes, N, costs, transfers, start,
                                  parallelism=table.concurrency, replicas=replicas,
                                  lock=lock, lock_whole=table.whole_lock_share(),
                                  pinned=pinned, in_turn=True, handovers=handovers)
        rates = ", ".join(f"{r:.2f}" for r in table.concurrency[:workers])
        said = (f"{workers} workers on {table.cores} cores: k passes at once run at the "
                f"calibrated rate of k concurrent passes ({rates} for k = 1, 2, …), an average")
        if workers > table.cores and table.device.startswith("cpu"):
            # measured, not modeled: benchmarks/calibration.md's 4-worker rows on 2 cores
            said += OVERSUBSCRIBED_NOTE + IN_TURN_NOTE
        else:
            said += ("; which worker the interpreter lock and the scheduler favour at each "
                     "moment is not modeled")
        notes.append(said)
    else:
        limit = int(cores if cores is not None else table.cores)
        limit = limit if limit < workers else None     # enough cores: no contention to model
        times = walk(schedule.lanes, N, costs, transfers, start, cores=limit,
                     replicas=replicas)
        if concurrent and not table.concurrency:
            notes.append("contention not calibrated: passes of different workers are modeled "
                         "as running in parallel up to the core count; interpreter-lock "
                         "contention between workers is left out")
    if concurrent and table.device.startswith("cpu"):
        notes.append(WAITED_NOTE)
    if training and schedule.kind in ("zb-h1", "zbv", "dualpipev") and "input-grad" not in c:
        notes.append(f"split backward modeled as {1 - table.weight_share:.0%} / "
                     f"{table.weight_share:.0%} of a full backward (I and W not measured)")

    def span_start(k: str, s: int, a: float, b: float) -> float:
        # a pass's fixed cost is measured as the idle gap before it (``per_pass``: the gap
        # between consecutive passes of a one-worker run), so its modeled span leaves that
        # share out, as a measured span does: busy shares count the same thing in both. A
        # backward's release (after its span, measured) is left out of the span alike,
        # drawn before it with the pass's fixed cost
        cost = costs[k][s]
        fixed = pass_cost + (freed[s] if k in (BACKWARD, WEIGHT_GRAD) else 0.0)
        if k == STEP or cost <= 0 or fixed <= 0:
            return a
        return a + (b - a) * min(1.0, fixed / cost)

    def events_of(times) -> List[Event]:
        events: List[Event] = []
        if before > 0:
            events.append(Event(-1, "host", -1, 0.0, before, -1, 0, 0, 0))
        for replica in range(replicas):
            for lane, lane_times in zip(schedule.lanes, times[replica]):
                events += [Event(s, KIND_NAMES[k], m, span_start(k, s, a, b), b, ipus[s],
                                 replica, it, 0)
                           for (k, s, m, it), (a, b) in zip(lane, lane_times)]
        end = max((e.end for e in events), default=start)
        if table.host_after > 0:
            events.append(Event(-1, "host", -1, end, end + table.host_after, -1, 0,
                                schedule.iterations - 1, 0))
        return events

    events = events_of(times)
    meta = {"schedule": schedule.kind, "num_stages": N, "micro_batches": micro_batches,
            "iterations": schedule.iterations, "replicas": replicas, "stage_ipus": ipus,
            "stage_blocks": [list(b) for b in stage_blocks], "calibrated": True,
            "cores": limit, "per_pass": table.per_pass, "handoff": table.handoff,
            "notes": notes}
    if samples is not None:
        meta["samples"] = samples
    if in_turn is not None:
        # the busy shares span what the OS may do with a core's workers (IN_TURN_NOTE)
        shared = Timeline(events).utilisation()["per_ipu"]
        turns = Timeline(events_of(in_turn), modeled=True)
        by_turn = turns.utilisation()["per_ipu"]
        meta["busy_range"] = {i: (min(shared[i], by_turn.get(i, 0.0)),
                                  max(shared[i], by_turn.get(i, 0.0))) for i in shared}
        meta["in_turn_wall_time"] = turns.wall_time
    return Timeline(events, modeled=True, meta=meta)
