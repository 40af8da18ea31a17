"""Balance a pipeline by measured time: which blocks should share a virtual IPU.

:func:`balance_by_time` measures every block (forward + backward) with each block on its
own IPU in :class:`~ipukit.ShardedExecution`, one at a time, and :func:`best_split` finds
the contiguous split whose slowest stage is fastest.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .core import blocks as _blocks
from .core.enums import AutoStage
from .core.errors import BlockError
from .core.options import Options
from .viz.memory import unchanged_state
from .core.strategies import PipelinedExecution, ShardedExecution, Stage
from .runtime.fused import action_by_action
from .runtime.gpu_clock import on_device_of, settle
from .runtime.split_backward import backward_input, backward_weight
from .model import PoplarExecutor, trainingModel, training_wrapper_set_aside
from .timeline.events import Timeline


def best_split(costs: Sequence[float], num_ipus: int) -> List[int]:
    """The IPU of each block: a contiguous split into ``num_ipus`` stages, slowest stage minimal
    (an exact dynamic programme; among optimal splits the earlier stages are as large as allowed).
    """
    costs = [float(c) for c in costs]
    B, K = len(costs), int(num_ipus)
    if K < 1:
        raise ValueError(f"num_ipus must be >= 1, got {num_ipus}")
    if K > B:
        raise ValueError(f"cannot split {B} block(s) over {K} IPUs: every IPU needs a block")
    prefix = list(itertools.accumulate(costs, initial=0.0))
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
    stages = [Stage(*[b for b, i in zip(block_order, split) if i == ipu]).ipu(ipu)
              for ipu in sorted(set(split))]
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


def _timed_calls(model: torch.nn.Module, batch: Tuple, options, probe=None,
                 between: Iterable[Callable[[], object]] = ()):
    """Time calls of a throw-away training model of ``model``: one compiling call, one timed call,
    ``probe(compiled)``, then each of ``between`` followed by a timed call. Returns (timelines,
    blocks per stage, probe's result).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params or [torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    with training_wrapper_set_aside(model), unchanged_state([model], weights=True):
        timing = trainingModel(model, options, optimizer)
        try:
            timing(*batch)     # compile + warm-up
            timing(*batch)
            timelines = [timing.getTimeline()]
            stage_blocks = [st.blocks for st in timing.program.partition.stages]
            probed = probe(timing) if probe is not None else None
            for measure in (between(timelines) if callable(between) else between):
                measure()
                timing(*batch)
                timelines.append(timing.getTimeline())
            return timelines, stage_blocks, probed
        finally:
            timing.destroy()


def measure_blocks(model: torch.nn.Module, sample_inputs, block_order: Sequence[str],
                   repeats: int = 5) -> Tuple[List[float], List[float], Timeline]:
    """Forward and backward seconds of each block (median of ``repeats`` passes of one micro-batch),
    every block its own IPU under ShardedExecution, and the call's timeline; the model is left
    unchanged.
    """
    fwd, bwd, _, _, timelines = _measure(model, sample_inputs, block_order, repeats, False)
    return fwd, bwd, timelines[0]


def measure_split_blocks(model: torch.nn.Module, sample_inputs, block_order: Sequence[str],
                         repeats: int = 5, between: Iterable[Callable[[], object]] = ()):
    """:func:`measure_blocks`, plus each block's split backward halves timed alone.

    Returns ``(forward, backward, input_grad, weight_grad, timelines)``, per block median
    seconds (``input_grad``/``weight_grad`` None when the stages cannot be driven directly).
    """
    return _measure(model, sample_inputs, block_order, repeats, True, between)


def _measure(model: torch.nn.Module, sample_inputs, block_order: Sequence[str], repeats: int,
             split: bool, between: Iterable[Callable[[], object]] = ()):
    repeats = max(1, int(repeats))
    args = as_args(sample_inputs)
    batch = tuple(_repeat(a, repeats) for a in args)
    options = Options()
    options.Training.gradientAccumulation(repeats)
    options.setExecutionStrategy(strategy_for(block_order, list(range(len(block_order))),
                                              sharded=True))
    probe = (lambda compiled: _split_probe(compiled, args, repeats)) if split else None
    with action_by_action():   # each pass timed alone, with a pipelined pass's bookkeeping
        timelines, stage_blocks, halves = _timed_calls(model, batch, options, probe, between)
    # the median pass: a modeled call sums typical passes, not the fastest
    costs = (Timeline.concat(timelines) if len(timelines) > 1 else timelines[0]).stage_costs(
        statistics.median)
    per = {k: {b: 0.0 for b in block_order} for k in "FBIW"}
    for s, names in enumerate(stage_blocks):
        for b in names:   # a stage holds one block here; share its time if it ever holds more
            per["F"][b] += costs["forward"][s] / len(names)
            per["B"][b] += costs["backward"][s] / len(names)
            if halves is not None:
                direct_b, direct_i, direct_w = halves[s]
                extra = max(0.0, costs["backward"][s] - direct_b)   # accumulation, bookkeeping
                per["I"][b] += direct_i / len(names)
                per["W"][b] += (direct_w + extra) / len(names)
    out = [[per[k][b] for b in block_order] for k in "FBIW"]
    if halves is None:
        out[2] = out[3] = None
    return (*out, timelines)


def _split_probe(compiled, args: Tuple, repeats: int):
    """Per stage of ``compiled`` (a one-block-per-stage training model): median seconds of
    a direct full backward, of ``I`` and of ``W`` (None if the stages cannot be driven)."""
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
    return result


def _split_halves(seeds, grads, inputs, params, t0: float) -> Tuple[float, float]:
    """A stage's split backward from ``seeds``, begun at ``t0``: seconds of ``I``, of ``W``."""
    _, pending = backward_input(seeds, grads, inputs, params)
    settle(seeds)
    t1 = time.perf_counter()
    backward_weight(pending, params)
    settle(seeds)
    return t1 - t0, time.perf_counter() - t1


def balance_by_time(model: torch.nn.Module, sample_inputs, num_ipus: int,
                    block_order: Optional[Sequence[str]] = None, repeats: int = 5) -> BalanceResult:
    """Place a block-annotated model's blocks on ``num_ipus`` IPUs by measured time.

    ``sample_inputs`` is one micro-batch (a tensor or a tuple of the model's
    arguments); the model must return its loss (or a tensor to differentiate)
    from the last block, as any ipukit training model. ``block_order`` defaults
    to the order the model enters its blocks. Returns a :class:`BalanceResult`
    whose ``strategy`` goes straight into ``options.setExecutionStrategy``.
    """
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
