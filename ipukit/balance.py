"""Balance a pipeline by measured time: which blocks should share a virtual IPU.

A pipeline runs at the pace of its slowest stage, so the best placement of
blocks on IPUs is the contiguous split that minimises the slowest stage's
time. :func:`balance_by_time` measures every block (forward + backward) by
running the model once with each block on its own IPU in
:class:`~ipukit.ShardedExecution` — one block at a time, so blocks do not
compete for cores — and :func:`best_split` finds the optimal split exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .core import blocks as _blocks
from .core.enums import AutoStage
from .core.errors import BlockError
from .viz.memory import unchanged_state
from .core.strategies import PipelinedExecution, ShardedExecution, Stage
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


def _timed_calls(model: torch.nn.Module, batch: Tuple,
                 options) -> Tuple[Timeline, List[List[str]]]:
    """Compile and warm up a throw-away training model, then time one call.

    Learning rate 0 and restored weights, buffers and random state leave the
    user's model as it was; a training wrapper the user already has stays.
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
                return timing.getTimeline(), [st.blocks for st in timing.program.partition.stages]
            finally:
                timing.destroy()


def measure_blocks(model: torch.nn.Module, sample_inputs, block_order: Sequence[str],
                   repeats: int = 5) -> Tuple[List[float], List[float], Timeline]:
    """Median forward and backward seconds of each block, one micro-batch = ``sample_inputs``.

    Runs the model with every block on its own IPU in ShardedExecution
    (stages one at a time, so blocks do not compete for cores): a warm-up
    call, then a call of ``repeats`` micro-batches whose timeline gives the
    medians. The user's model is left unchanged.
    """
    from .core.options import Options

    repeats = max(1, int(repeats))
    batch = tuple(_repeat(a, repeats) for a in as_args(sample_inputs))
    options = Options()
    options.Training.gradientAccumulation(repeats)
    options.setExecutionStrategy(strategy_for(block_order, list(range(len(block_order))),
                                              sharded=True))
    timeline, stage_blocks = _timed_calls(model, batch, options)
    costs = timeline.stage_costs("median")
    fwd = {b: 0.0 for b in block_order}
    bwd = {b: 0.0 for b in block_order}
    for s, names in enumerate(stage_blocks):
        for b in names:   # a stage holds one block here; share its time if it ever holds more
            fwd[b] += costs["forward"][s] / len(names)
            bwd[b] += costs["backward"][s] / len(names)
    return [fwd[b] for b in block_order], [bwd[b] for b in block_order], timeline


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
