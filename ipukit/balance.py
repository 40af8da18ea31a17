"""Balance a pipeline by measured time: which blocks should share a virtual IPU.

A pipeline runs at the pace of its slowest stage, so the best placement of
blocks on IPUs is the contiguous split that minimises the slowest stage's
time. :func:`balance_by_time` measures every block (forward + backward) by
running the model once with each block on its own IPU in
:class:`~ipukit.ShardedExecution` — one block at a time, so blocks do not
compete for cores — and :func:`best_split` finds the optimal split exactly.
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .core import blocks as _blocks
from .core.enums import AutoStage
from .core.errors import BlockError
from .viz.memory import unchanged_state
from .core.strategies import PipelinedExecution, ShardedExecution, Stage
from .runtime.fused import action_by_action
from .timeline.events import Timeline


# -- the split -----------------------------------------------------------------------------

def best_split(costs: Sequence[float], num_ipus: int) -> List[int]:
    """The IPU of each block: a contiguous split into ``num_ipus`` stages, slowest stage minimal.

    Exact dynamic programme over prefixes (O(B² × K)); every IPU gets at least
    one block. Among optimal splits, the one whose earlier stages are as
    large as allowed is returned (deterministic).
    """
    costs = [float(c) for c in costs]
    B, K = len(costs), int(num_ipus)
    if K < 1:
        raise ValueError(f"num_ipus must be >= 1, got {num_ipus}")
    if K > B:
        raise ValueError(f"cannot split {B} block(s) over {K} IPUs: every IPU needs a block")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][b]: the smallest bottleneck of blocks[:b] on k IPUs; cut[k][b]: where stage k starts
    best = [[inf] * (B + 1) for _ in range(K + 1)]
    cut = [[0] * (B + 1) for _ in range(K + 1)]
    best[0][0] = 0.0
    for k in range(1, K + 1):
        for b in range(k, B - (K - k) + 1):
            for a in range(k - 1, b):
                value = max(best[k - 1][a], prefix[b] - prefix[a])
                if value <= best[k][b]:   # "<=": latest start of the last stage wins ties
                    best[k][b] = value
                    cut[k][b] = a
    split = [0] * B
    b = B
    for k in range(K, 0, -1):
        a = cut[k][b]
        for i in range(a, b):
            split[i] = k - 1
        b = a
    return split


def stage_totals(costs: Sequence[float], split: Sequence[int]) -> List[float]:
    """Summed cost of each IPU's blocks."""
    totals = [0.0] * (max(split) + 1 if split else 0)
    for c, ipu in zip(costs, split):
        totals[ipu] += float(c)
    return totals


def strategy_for(block_order: Sequence[str], split: Sequence[int],
                 sharded: bool = False) -> PipelinedExecution:
    """``PipelinedExecution(Stage(...).ipu(0), ...)`` placing ``block_order`` per ``split``."""
    stages = []
    for ipu in sorted(set(split)):
        stages.append(Stage(*[b for b, i in zip(block_order, split) if i == ipu]).ipu(ipu))
    return (ShardedExecution if sharded else PipelinedExecution)(*stages)


@dataclass
class BalanceResult:
    """A measured placement: per-block costs, the chosen split and its strategy."""

    blocks: List[str]
    block_costs: List[float]          # seconds per micro-batch, forward + backward
    split: List[int]                  # the IPU of each block
    stage_costs: List[float]          # seconds per micro-batch per IPU
    strategy: PipelinedExecution
    forward_costs: List[float] = field(default_factory=list)
    backward_costs: List[float] = field(default_factory=list)
    timeline: Optional[Timeline] = None

    @property
    def bottleneck(self) -> float:
        """The slowest stage's time per micro-batch: what limits the pipeline."""
        return max(self.stage_costs) if self.stage_costs else 0.0

    @property
    def balance(self) -> float:
        """Mean stage time ÷ slowest stage time (1.0 is perfectly balanced)."""
        if not self.stage_costs or self.bottleneck <= 0:
            return 1.0
        return sum(self.stage_costs) / len(self.stage_costs) / self.bottleneck

    def to_dict(self) -> Dict[str, Any]:
        return {"blocks": list(self.blocks), "block_costs": list(self.block_costs),
                "split": list(self.split), "stage_costs": list(self.stage_costs),
                "bottleneck": self.bottleneck, "balance": self.balance,
                "strategy": self.strategy._to_dict()}

    def __repr__(self) -> str:
        ms = ", ".join(f"{c * 1e3:.2f}" for c in self.stage_costs)
        return (f"BalanceResult(split={self.split}, stage ms=[{ms}], "
                f"bottleneck {self.bottleneck * 1e3:.2f} ms, balance {self.balance:.0%})")


# -- measuring blocks ----------------------------------------------------------------------

class _BlockNames(_blocks.BlockRecorder):
    """Records the order in which blocks are entered, without cutting anything."""

    def begin(self, user_id, ipu_id):
        if user_id is None:
            user_id = self.assigner.next_auto_id()
        user_id = str(user_id)
        if user_id not in self.entered:
            self.entered.append(user_id)
        self.in_block = True
        return user_id


def as_args(sample_inputs) -> Tuple:
    return tuple(sample_inputs) if isinstance(sample_inputs, (tuple, list)) else (sample_inputs,)


def discover_blocks(model: torch.nn.Module, sample_inputs) -> List[str]:
    """Block ids in the order ``model`` enters them on ``sample_inputs`` (one eager run)."""
    recorder = _BlockNames(PipelinedExecution(AutoStage.AutoIncrement).stage_manager())
    previous = _blocks.set_recorder(recorder)
    try:
        with unchanged_state([model]), torch.no_grad():
            model(*as_args(sample_inputs))
    finally:
        _blocks.set_recorder(previous)
    return list(recorder.entered)


def _repeat(value, times: int):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.repeat(times, *([1] * (value.dim() - 1)))
    return value


def _timed_calls(model: torch.nn.Module, batch: Tuple, options,
                 probe=None, between: Sequence[Callable[[], object]] = (),
                 more: Optional[List[Timeline]] = None) -> Tuple[Timeline, List[List[str]]]:
    """Compile and warm up a throw-away training model, then time one call.

    Learning rate 0 and restored weights, buffers and random state leave the
    user's model as it was; a training wrapper the user already has stays.
    ``probe(compiled)``, when given, runs after the timed call, before the state is
    restored; its result is appended to the returned tuple. Then each of ``between`` runs
    (other measurements, which must leave the model alone), each followed by another timed
    call, whose timeline is appended to ``more``: the same passes timed at moments seconds
    apart.
    """
    from .model import trainingModel, training_wrapper_set_aside

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params or [torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    with training_wrapper_set_aside(model):
        with unchanged_state([model], weights=True):
            timing = trainingModel(model, options, optimizer)
            try:
                timing(*batch)     # compile + warm-up
                timing(*batch)
                out = (timing.getTimeline(),
                       [st.blocks for st in timing.program.partition.stages])
                if probe is not None:
                    out = out + (probe(timing),)
                for measure in between:
                    measure()
                    timing(*batch)
                    if more is not None:
                        more.append(timing.getTimeline())
                return out
            finally:
                timing.destroy()


def measure_blocks(model: torch.nn.Module, sample_inputs, block_order: Sequence[str],
                   repeats: int = 5) -> Tuple[List[float], List[float], Timeline]:
    """Forward and backward seconds of each block (the median of its passes), one micro-batch = ``sample_inputs``.

    Runs the model with every block on its own IPU in ShardedExecution
    (stages one at a time, so blocks do not compete for cores): a warm-up
    call, then a call of ``repeats`` micro-batches whose timeline gives the
    medians. The user's model is left unchanged.
    """
    fwd, bwd, _, _, timeline = _measure(model, sample_inputs, block_order, repeats, False)
    return fwd, bwd, timeline


def measure_split_blocks(model: torch.nn.Module, sample_inputs, block_order: Sequence[str],
                         repeats: int = 5, between: Sequence[Callable[[], object]] = (),
                         lock_shares: Optional[Dict[str, List[float]]] = None,
                         graph: Optional[Dict[str, list]] = None):
    """:func:`measure_blocks`, plus each block's split backward timed alone.

    Returns ``(forward, backward, input_grad, weight_grad, timeline)``: per block, the
    median seconds of its forward and full backward in the sharded run, and of the two
    halves a zero-bubble schedule runs instead — ``I`` (the gradient of the block's input,
    keeping the graph) and ``W`` (the weight gradients from what ``I`` kept), each timed
    on its own with the runtime's own functions (:mod:`ipukit.runtime.split_backward`)
    on the compiled stage and the activation the sharded run passes it. The gradient
    accumulation a real ``W`` does is the full backward's (sharded run − this direct
    backward), added to ``W``. ``input_grad`` and ``weight_grad`` are None when the
    stages cannot be driven directly (inputs other than tensors).

    ``between``: other measurements (leaving the model alone), each followed by another
    timed call of the same passes; a block's forward and backward are then the median over
    every call's passes, so a few seconds of a slower machine during one call move them
    less (on a 2-core VM the ViT's blocks, timed once per calibration, summed 15-16 ms in
    four calibrations of six and 21-26 ms in two).

    ``lock_shares``: a dict to fill, per pass kind (``"forward"``, ``"backward"``,
    ``"input_grad"``, ``"weight_grad"``), with each block's interpreter-lock share
    (:func:`lock_share`): its passes timed on a worker thread with a twin running the same
    passes beside it, against alone.

    ``graph``: a dict to fill with each block's ``"graph_walk"`` (seconds the autograd
    engine takes to walk its graph once: :func:`graph_walk`) and ``"weight_calls"`` (the
    separate gradient calls its ``W`` makes, one per parameter group), what a ``W`` of a
    stage of several blocks pays beyond their sum (see
    :attr:`ipukit.timeline.costs.CostTable.graph_walk`).
    """
    return _measure(model, sample_inputs, block_order, repeats, True, between, lock_shares,
                    graph)


def lock_share(alone: float, beside_twin: float, noise: float = 0.1) -> float:
    """The share of a pass's time it holds the interpreter lock, from its duration
    ``alone`` and ``beside_twin`` (a second thread running the same pass at once, each on
    its own core).

    A pass that holds the lock for a share g of its time, beside passes holding it for
    shares g_j, waits about g × Σ g_j of its time for them (each time it wants the lock,
    another holds it about g_j of the time): so beside its twin it takes 1 + g² of its
    time alone, and g = √(stretch − 1), at most 1. Measured on 2 cores with one intra-op
    thread each (the convnet's blocks, passes of 40 to 1,800 µs): the convolutions'
    passes 1.00-1.02 beside their twins (g ≈ 0.1), the Linear(320, 256) block's
    1.22-1.43 (g 0.5-0.7), the last Linear and its loss 2.5-3.0 (g = 1); and beside
    another block, as g × g_j predicts within 0.1 where either share is small (the
    convolutions beside the last block 1.09-1.16; that block beside them 1.04-1.11).
    A stretch within ``noise`` of 1 reads as no share: the convolutions' passes, timed a
    few times each, came out 0.97-1.09 beside their twins, which the square root would
    read as shares up to 0.3.
    """
    if alone <= 0:
        return 0.0
    return min(1.0, max(0.0, beside_twin / alone - 1.0 - noise) ** 0.5)


def _measure(model: torch.nn.Module, sample_inputs, block_order: Sequence[str], repeats: int,
             split: bool, between: Sequence[Callable[[], object]] = (),
             lock_shares: Optional[Dict[str, List[float]]] = None,
             graph: Optional[Dict[str, list]] = None):
    from .core.options import Options

    repeats = max(1, int(repeats))
    args = as_args(sample_inputs)
    batch = tuple(_repeat(a, repeats) for a in args)
    options = Options()
    options.Training.gradientAccumulation(repeats)
    options.setExecutionStrategy(strategy_for(block_order, list(range(len(block_order))),
                                              sharded=True))
    shares: Optional[List[Dict[str, float]]] = [] if lock_shares is not None else None
    walks: Optional[List[Tuple[float, int]]] = [] if graph is not None else None
    probe = (lambda compiled: _split_probe(compiled, args, repeats, shares, walks)) \
        if split else None
    with action_by_action():   # each pass timed alone, with a pipelined pass's bookkeeping
        more: List[Timeline] = []
        timeline, stage_blocks, *halves = _timed_calls(model, batch, options, probe=probe,
                                                       between=between, more=more)
    halves = halves[0] if halves else None
    # the median pass: a modeled call sums typical passes (the fastest half's median ran
    # 5-11 % under the passes of the calls it predicted, on a quiet machine)
    costs = (Timeline.concat([timeline] + more) if more else timeline).stage_costs(
        statistics.median)
    per = {k: {b: 0.0 for b in block_order} for k in ("F", "B", "I", "W")}
    for s, names in enumerate(stage_blocks):
        for b in names:   # a stage holds one block here; share its time if it ever holds more
            per["F"][b] += costs["forward"][s] / len(names)
            per["B"][b] += costs["backward"][s] / len(names)
            if halves is not None:
                direct_b, direct_i, direct_w = halves[s]
                extra = max(0.0, costs["backward"][s] - direct_b)   # accumulation, bookkeeping
                per["I"][b] += direct_i / len(names)
                per["W"][b] += (direct_w + extra) / len(names)
    out = [[per[k][b] for b in block_order] for k in ("F", "B", "I", "W")]
    if lock_shares is not None and shares and len(shares) == len(stage_blocks):
        index = {b: i for i, b in enumerate(block_order)}
        for kind in ("forward", "backward", "input_grad", "weight_grad"):
            lock_shares[kind] = [0.0] * len(block_order)
            for names, share in zip(stage_blocks, shares):
                for b in names:
                    lock_shares[kind][index[b]] = share[kind]
    if graph is not None and walks and len(walks) == len(stage_blocks):
        index = {b: i for i, b in enumerate(block_order)}
        graph["graph_walk"] = [0.0] * len(block_order)
        graph["weight_calls"] = [0] * len(block_order)
        for names, (seconds, calls) in zip(stage_blocks, walks):
            for b in names:
                graph["graph_walk"][index[b]] = seconds / len(names)
                graph["weight_calls"][index[b]] = calls
    if halves is None:
        out[2] = out[3] = None
    return out[0], out[1], out[2], out[3], timeline


def _split_probe(compiled, args: Tuple, repeats: int,
                 shares: Optional[List[Dict[str, float]]] = None,
                 walks: Optional[List[Tuple[float, int]]] = None):
    """Per stage of ``compiled`` (a one-block-per-stage training model): median seconds of
    a direct full backward, of ``I`` and of ``W`` (None if the stages cannot be driven).

    ``shares``: a list to append each stage's interpreter-lock shares to (per pass kind,
    :func:`lock_share`), its passes timed on worker threads alone and beside a twin.
    ``walks``: a list to append each stage's ``(graph_walk(...), weight calls)`` to."""

    from .runtime.gpu_clock import on_device_of, settle

    if not all(isinstance(a, torch.Tensor) for a in args):
        return None
    partition = compiled.program.partition
    loss = (partition.outputs[partition.loss_output]
            if partition.loss_output is not None else None)
    outputs: Dict[int, Any] = {}
    result = []

    def item(outs, index):     # outs: a stage's outputs as a tuple
        return outs[index or 0]

    def forward(stage, stage_args, used):
        """The stage's outputs (a tuple), and the seeds of its backward with their grads."""
        out = stage.module(*stage_args)
        out = tuple(out) if stage.tuple_output else (out,)
        seeds = [item(out, i) for i in used]
        if loss is not None and loss.kind == "stage" and loss.index == stage.index:
            seeds.append(item(out, loss.item))
        seeds = [t for t in seeds if isinstance(t, torch.Tensor) and t.requires_grad]
        return out, seeds, [torch.ones_like(t) for t in seeds]

    with torch.enable_grad():
        for stage in partition.stages:
            stage_args = []
            for ref in stage.args:
                if ref.kind == "input":
                    if ref.index >= len(args):
                        return None
                    v = args[ref.index]
                elif ref.kind == "stage":
                    v = item(outputs[ref.index], ref.item)
                    if isinstance(v, torch.Tensor):
                        v = on_device_of(stage.parameters, (v.detach(),))[0]
                        v = v.requires_grad_(v.is_floating_point())
                else:
                    v = ref.value
                stage_args.append(v)
            stage_args = list(on_device_of(stage.parameters, stage_args))  # a GPU's stage
            params = [p for p in stage.parameters if p.requires_grad]
            inputs = [v for v in stage_args if isinstance(v, torch.Tensor) and v.requires_grad]
            used = sorted({i for c, _, i in partition.consumers(stage.index)},
                          key=lambda i: -1 if i is None else i)
            spans: Dict[str, List[float]] = {"B": [], "I": [], "W": []}
            out = None
            for r in range(repeats + 1):
                for half in ("B", "IW"):
                    out, seeds, grads = forward(stage, stage_args, used)
                    if not seeds:
                        continue
                    settle(seeds)
                    t0 = time.perf_counter()
                    if half == "B":
                        torch.autograd.grad(seeds, inputs + params, grads, allow_unused=True)
                        settle(seeds)
                        spans["B"].append(time.perf_counter() - t0)
                        continue
                    i_span, w_span = _split_halves(seeds, grads, inputs, params, t0)
                    spans["I"].append(i_span)
                    spans["W"].append(w_span)
            outputs[stage.index] = out
            result.append(tuple(statistics.median(spans[k][1:] or spans[k] or [0.0])
                                for k in ("B", "I", "W")))
            if walks is not None:   # on a graph of its own (the halves freed theirs)
                _, seeds, grads = forward(stage, stage_args, used)
                walks.append((graph_walk(seeds, grads, repeats),
                              weight_calls(seeds, grads, inputs, params)))
            if shares is not None:
                shares.append(_twin_shares(stage, stage_args, inputs, params, used, loss,
                                           max(3, repeats // 2)))
    return result


def _grad_timer(batch: int = 5):
    """A timer of ``batch`` gradient calls from ``roots`` to a target outside every graph
    (so the engine walks the graph below ``roots`` to find out, and runs none of it):
    seconds per call."""
    outside = torch.zeros(1, requires_grad=True)

    def timed(roots, seeds_grads) -> float:
        t0 = time.perf_counter()
        for _ in range(batch):
            torch.autograd.grad(roots, [outside], seeds_grads, retain_graph=True,
                                allow_unused=True)
        return (time.perf_counter() - t0) / batch
    return timed


def _one_node_graph(device=None):
    """A graph of one node, and the gradient to seed it with."""
    leaf = torch.zeros(1, requires_grad=True, device=device)
    with torch.enable_grad():
        tiny = [leaf * 1.0]
    return tiny, [torch.ones(1, device=device)]


def graph_walk(seeds: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               repeats: int = 5) -> float:
    """Seconds the autograd engine takes to walk the graph below ``seeds`` once.

    Timed as a gradient call that needs nothing from the graph (its one target lies
    outside it, so the engine walks every node to find out and runs none), less the same
    call on a one-node graph (:func:`gradient_call`). Every separate gradient call walks
    the whole graph below its start, and a zero-bubble ``W`` makes one per parameter group
    (:func:`ipukit.runtime.split_backward.backward_weight`, as torch's
    ``stage_backward_weight`` does): in a stage of several blocks each block's calls also
    walk the blocks before it (a ViT encoder layer, on 2 CPU cores: a walk of 20-27 µs,
    and its six calls 0.15-0.6 ms each, more the more layers lie below; its layers' ``W``
    in one stage of 4 cost 1.2×, of 8 1.45× their sum).
    """
    seeds, grads = list(seeds), list(grads)
    if not seeds:
        return 0.0
    tiny, one = _one_node_graph()
    timed = _grad_timer()
    timed(seeds, grads), timed(tiny, one)       # warm-up: the first walk is slower
    full: List[float] = []
    base: List[float] = []
    for _ in range(max(5, 2 * int(repeats))):   # in turn, so a slower moment hits both
        full.append(timed(seeds, grads))
        base.append(timed(tiny, one))
    return max(0.0, statistics.median(full) - statistics.median(base))


def gradient_call(repeats: int = 5, device=None) -> float:
    """Seconds of a gradient call's fixed cost: one call on a one-node graph (the call
    from Python, the engine's start and finish), on ``device``.

    Each block's backward is timed as a gradient call of its own; a pipelined stage's
    backward is one call over all its blocks, and a sharded call's one call over the
    whole model per micro-batch, so they pay this fewer times than their blocks' sum
    (:attr:`ipukit.timeline.costs.CostTable.grad_call`; on 2 CPU cores 15-20 µs).
    """
    tiny, one = _one_node_graph(device)
    timed = _grad_timer()
    timed(tiny, one)                            # warm-up
    return statistics.median(timed(tiny, one) for _ in range(max(5, 2 * int(repeats))))


def weight_calls(seeds, grads, inputs, params) -> int:
    """The separate gradient calls a stage's ``W`` makes (one per parameter group, and
    one for the parameters no input path reaches); its ``I`` is run to find them."""
    from ._torch import grad_fn_or_grad_acc
    from .runtime.split_backward import backward_input

    if not seeds or not params:
        return 0
    _, pending = backward_input(list(seeds), list(grads), list(inputs), list(params))
    grouped = {n for group in pending.groups for n in group["params"]}
    rest = any(grad_fn_or_grad_acc(p) not in grouped for p in params)
    return len(pending.groups) + (1 if rest else 0)


def _split_halves(seeds, grads, inputs, params, t0: float) -> Tuple[float, float]:
    """A stage's split backward from ``seeds``, begun at ``t0``: seconds of ``I``, of ``W``."""
    from .runtime.gpu_clock import settle
    from .runtime.split_backward import backward_input, backward_weight

    _, pending = backward_input(seeds, grads, inputs, params)
    settle(seeds)
    t1 = time.perf_counter()
    backward_weight(pending, params)
    settle(seeds)
    return t1 - t0, time.perf_counter() - t1


def _twin_shares(stage, stage_args, inputs, params, used, loss, repeats: int,
                 least_seconds: float = 0.02) -> Dict[str, float]:
    """One stage's interpreter-lock share per pass kind (:func:`lock_share`): its forward,
    full backward and split halves timed on a worker thread (a pipeline worker's intra-op
    threads for two workers) alone, then on two such threads at once — started together,
    each for ``repeats`` rounds and ``least_seconds``, a pass counted only if it ended
    before either thread stopped (so each ran beside its twin)."""
    from .runtime.executor import default_threads
    from .runtime.gpu_clock import settle

    threads = default_threads(2)
    kinds = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad"}

    def passes(spans: Dict[str, List[float]], gate, stopped: List[float]) -> None:
        torch.set_num_threads(threads)
        gate.wait()
        end = time.perf_counter() + least_seconds
        r = -1
        with torch.enable_grad():
            while not stopped and (r < repeats or time.perf_counter() < end):
                r += 1
                for half in ("B", "IW"):
                    t0 = time.perf_counter()
                    out = stage.module(*stage_args)
                    out = tuple(out) if stage.tuple_output else (out,)
                    seeds = [out[i or 0] for i in used]
                    if loss is not None and loss.kind == "stage" and loss.index == stage.index:
                        seeds.append(out[loss.item or 0])
                    seeds = [t for t in seeds if isinstance(t, torch.Tensor) and t.requires_grad]
                    settle(seeds)
                    t1 = time.perf_counter()
                    if not seeds:
                        continue
                    grads = [torch.ones_like(t) for t in seeds]
                    if half == "B":
                        torch.autograd.grad(seeds, inputs + params, grads, allow_unused=True)
                        settle(seeds)
                        t2 = time.perf_counter()
                        if r and not stopped:
                            spans["F"].append(t1 - t0)
                            spans["B"].append(t2 - t1)
                        continue
                    i_span, w_span = _split_halves(seeds, grads, inputs, params, t1)
                    if r and not stopped:
                        spans["I"].append(i_span)
                        spans["W"].append(w_span)
        stopped.append(time.perf_counter())

    def on_threads(n: int) -> Dict[str, List[float]]:
        spans: List[Dict[str, List[float]]] = [{k: [] for k in kinds} for _ in range(n)]
        failed: List[BaseException] = []
        gate, stopped = threading.Barrier(n), []

        def work(i: int) -> None:
            try:
                passes(spans[i], gate, stopped)
            except BaseException as exc:  # raised again on the calling thread
                failed.append(exc)
                gate.abort()

        pool = [threading.Thread(target=work, args=(i,), daemon=True,
                                 name=f"ipukit-calibrate-twin-{i}") for i in range(n)]
        for t in pool:
            t.start()
        interrupted = False
        for t in pool:   # Ctrl-C waits for the threads (milliseconds): none is left running
            while t.is_alive():
                try:
                    t.join()
                except KeyboardInterrupt:
                    interrupted = True
        if interrupted:
            raise KeyboardInterrupt
        if failed:
            raise failed[0]
        return {k: [v for sp in spans for v in sp[k]] for k in kinds}

    alone, twins = on_threads(1), on_threads(2)
    return {name: (lock_share(statistics.median(alone[k]), statistics.median(twins[k]))
                   if alone[k] and twins[k] else 0.0)
            for k, name in kinds.items()}


def balance_by_time(model: torch.nn.Module, sample_inputs, num_ipus: int,
                    block_order: Optional[Sequence[str]] = None, repeats: int = 5) -> BalanceResult:
    """Place a block-annotated model's blocks on ``num_ipus`` IPUs by measured time.

    ``sample_inputs`` is one micro-batch (a tensor or a tuple of the model's
    arguments); the model must return its loss (or a tensor to differentiate)
    from the last block, as any ipukit training model. ``block_order`` defaults
    to the order the model enters its blocks. Returns a :class:`BalanceResult`
    whose ``strategy`` goes straight into ``options.setExecutionStrategy``.
    """
    from .model import PoplarExecutor

    if isinstance(model, PoplarExecutor):
        model = model.model
    order = list(block_order) if block_order is not None else discover_blocks(model, sample_inputs)
    if not order:
        raise BlockError("balance_by_time(): the model entered no Block; annotate it with "
                         "ipukit.Block(...) / ipukit.BeginBlock(...) first.")
    if num_ipus > len(order):
        raise ValueError(f"balance_by_time(): {num_ipus} IPUs but only {len(order)} blocks "
                         f"({order}); every IPU needs at least one block")
    fwd, bwd, timeline = measure_blocks(model, sample_inputs, order, repeats)
    costs = [f + b for f, b in zip(fwd, bwd)]
    split = best_split(costs, num_ipus)
    return BalanceResult(blocks=order, block_costs=costs, split=split,
                         stage_costs=stage_totals(costs, split),
                         strategy=strategy_for(order, split), forward_costs=fwd,
                         backward_costs=bwd, timeline=timeline)
