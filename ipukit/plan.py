"""Plan a pipelined training run: ``ipukit.plan(model, sample_inputs, ipus=..., ...)``.

The planner searches splits × schedules × micro-batch sizes × recomputation, models each
candidate's time from calibrated costs and its memory per IPU, and returns the fastest
:class:`Plan` that fits the budget, with the alternatives and why the others were rejected.
Everything it reports is modeled (block costs interpolated between the two calibrated
micro-batch sizes, activation bytes scaled with the micro-batch size).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .balance import as_args, discover_blocks, stage_totals, strategy_for
from .calibrate import calibrate
from .model import PoplarExecutor, trainingModel, training_wrapper_set_aside
from .core.errors import OptionsError, PipelineConfigError
from .core.blocks import active_recorder
from .core.options import Options
from .core.strategies import PipelinedExecution, ShardedExecution, Stage
from .schedules.build import build
from .schedules.generators import minimum_micro_batches, placement
from .schedules.ir import BACKWARD, FORWARD, WEIGHT_GRAD, ScheduleError
from .schedules.registry import KINDS_BY_NAME, PIPELINED, kind_of, title_of
from .timeline.costs import CostTable, even_split, model_call
from .timeline.simulate import available_cores
from .viz import memory as memory_model

#: Splits modeled per stage count and micro-batch size (the best by their slowest stage).
SPLITS_KEPT = 8
MIB = 2 ** 20


@dataclass
class BlockMemory:
    """Bytes per block: ``weights`` (parameters, gradient accumulators, optimiser state) and
    what one micro-batch of ``micro_batch`` samples keeps until its backward
    (``activations``; ``inputs`` / ``outputs`` alone are what a recomputing stage keeps)."""

    blocks: List[str]
    weights: List[int]
    activations: List[float]
    inputs: List[float]
    outputs: List[float]
    micro_batch: int
    notes: List[str] = field(default_factory=list)

    def scaled(self, micro_batch: int) -> "BlockMemory":
        r = micro_batch / self.micro_batch if self.micro_batch else 1.0
        return dataclasses.replace(self, activations=[a * r for a in self.activations],
                                   inputs=[a * r for a in self.inputs],
                                   outputs=[a * r for a in self.outputs], micro_batch=micro_batch)

    def stage_activation(self, first: int, last: int, recompute: bool) -> float:
        """One micro-batch's held bytes of a stage of blocks ``first..last``."""
        if recompute:
            return self.inputs[first] + self.outputs[last]
        inner = sum(self.outputs[b] for b in range(first, last))
        return max(0.0, sum(self.activations[first:last + 1]) - inner)


@dataclass
class Rejection:
    """A candidate the planner did not keep, and why."""

    schedule: str
    micro_batch: int
    gradient_accumulation: int
    reason: str
    split: Optional[List[int]] = None          # blocks per stage
    recompute: List[int] = field(default_factory=list)
    over_budget: Dict[int, int] = field(default_factory=dict)   # IPU -> bytes over
    time_per_sample: Optional[float] = None

    def __str__(self) -> str:
        where = f"split {self.split}, " if self.split else ""
        rc = f", recompute stages {self.recompute}" if self.recompute else ""
        return (f"{title_of(self.schedule)}, {where}micro-batch {self.micro_batch} × "
                f"{self.gradient_accumulation}{rc}: {self.reason}")


@dataclass
class Plan:
    """A planned run (modeled): where the blocks go, how the step is scheduled and batched.

    ``stages`` names the blocks of each stage, ``stage_ipus`` places them, ``recompute``
    lists the stages that recompute their forward, ``memory_per_ipu`` is the modeled peak in
    bytes. ``modeled_only``: this machine has fewer cores (or devices) than ``ipus``. The
    plan :func:`plan` returns carries ``alternatives`` (every plan that fits, fastest first)
    and ``rejected``.
    """

    blocks: List[str]
    stages: List[List[str]]
    stage_ipus: List[int]
    schedule: str
    micro_batch: int
    gradient_accumulation: int
    device_iterations: int
    recompute: List[int]
    time_per_call: float
    memory_per_ipu: List[int]
    ipus: int
    memory_budget: Optional[List[int]] = None
    modeled_only: bool = False
    notes: List[str] = field(default_factory=list)
    alternatives: List["Plan"] = field(default_factory=list, repr=False)
    rejected: List[Rejection] = field(default_factory=list, repr=False)
    planning_seconds: float = 0.0

    @property
    def split(self) -> List[int]:
        return [len(s) for s in self.stages]

    def layers_per_ipu(self, layers: Sequence[str]) -> List[int]:
        """How many of ``layers`` (the blocks an IPUConfig counts) each stage holds."""
        chosen = set(layers)
        return [sum(b in chosen for b in stage) for stage in self.stages]

    @property
    def samples_per_call(self) -> int:
        return self.micro_batch * self.gradient_accumulation * self.device_iterations

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.gradient_accumulation

    @property
    def time_per_sample(self) -> float:
        return self.time_per_call / self.samples_per_call

    @property
    def throughput(self) -> float:
        """Modeled samples per second."""
        return self.samples_per_call / self.time_per_call if self.time_per_call > 0 else 0.0

    @property
    def peak_memory(self) -> int:
        return max(self.memory_per_ipu) if self.memory_per_ipu else 0

    @property
    def title(self) -> str:
        """The schedule as ``Options.pipelineSchedule`` names it."""
        return title_of(self.schedule)

    def strategy(self):
        """The execution strategy placing the plan's stages (``setExecutionStrategy``)."""
        stages = [Stage(*b).ipu(i) for b, i in zip(self.stages, self.stage_ipus)]
        if self.schedule == "sharded":
            return ShardedExecution(*stages)
        if len(set(self.stage_ipus)) == len(self.stages):
            return strategy_for(self.blocks, [i for b, i in zip(self.stages, self.stage_ipus)
                                              for _ in b])
        return PipelinedExecution(*stages)

    def options(self):
        """``ipukit.Options`` for the plan (batch the data with ``batch_size=plan.micro_batch``)."""
        opts = Options().deviceIterations(self.device_iterations)
        opts.Training.gradientAccumulation(self.gradient_accumulation)
        opts.setExecutionStrategy(self.strategy())
        if self.schedule != "sharded":
            opts.pipelineSchedule(self.title)
        return opts

    def apply(self, model: Optional[torch.nn.Module] = None):
        """The plan's :meth:`options`; with ``model``, its recomputing stages are marked too (forward
        pre-hooks, in ``model._ipukit_plan_hooks``). A plan that recomputes needs ``model``.
        """
        if self.recompute and model is None:
            raise OptionsError(
                f"Plan.apply(): the plan recomputes stages {self.recompute}; pass the model "
                "(plan.apply(model)) so its stages can be marked for recomputation.")
        if model is not None:
            for handle in getattr(model, "_ipukit_plan_hooks", []):
                handle.remove()
            targets = {b for s in self.recompute for b in self.stages[s]}
            hook = _RecomputeMark(targets)
            model._ipukit_plan_hooks = [m.register_forward_pre_hook(hook)
                                        for m in model.modules()] if targets else []
        return self.options()

    def summary(self) -> str:
        rc = f", recompute stages {self.recompute}" if self.recompute else ""
        return (f"{self.title} on {self.ipus} IPUs, split {self.split} (stage IPUs "
                f"{self.stage_ipus}), micro-batch {self.micro_batch} × accumulation "
                f"{self.gradient_accumulation} × device iterations {self.device_iterations}{rc}"
                f"; {self.why_accumulation()}")

    def why_accumulation(self) -> str:
        """The schedule's minimum accumulation against what the global batch gives."""
        n, p = len(self.stages), self.ipus
        least = minimum_micro_batches(self.schedule, n, len(set(self.stage_ipus)))
        popart = f"2N − 1 = {least} for N = {n} stages (PopART's rule)"
        rule = {"gpipe": popart, "1f1b": popart,
                "dualpipev": f"two per IPU, {least}"}.get(self.schedule, f"one per IPU, {least}")
        if self.schedule == "sharded":
            return (f"accumulation {self.gradient_accumulation}: sharded execution needs no "
                    "minimum; the global batch over the micro-batch size gives it")
        return (f"accumulation {self.gradient_accumulation}: {self.title} needs at least "
                f"{rule} on {p} IPUs; the global batch over the micro-batch size gives "
                f"{self.gradient_accumulation}")

    def table(self, rows: int = 10, rejections: int = 10) -> str:
        """The ranked alternatives and the rejections, as a Markdown table."""
        lines = ["| rank | schedule | split | stage IPUs | micro-batch × GA | recompute | "
                 "ms / sample | samples/s | peak MiB per IPU |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for rank, p in enumerate((self.alternatives or [self])[:rows], 1):
            mem = ", ".join(f"{b / MIB:.2f}" for b in p.memory_per_ipu)
            lines.append(f"| {rank} | {p.title} | {p.split} | {p.stage_ipus} | "
                         f"{p.micro_batch} × {p.gradient_accumulation} | "
                         f"{p.recompute or '-'} | {p.time_per_sample * 1e3:.4f} | "
                         f"{p.throughput:.0f} | {mem} |")
        more = len(self.alternatives) - rows
        if more > 0:
            lines.append(f"\n… and {more} more plans that fit.")
        if self.rejected:
            lines.append(f"\nRejected ({len(self.rejected)}):")
            for r in self.rejected[:rejections]:
                lines.append(f"- {r}")
            if len(self.rejected) > rejections:
                lines.append(f"- … and {len(self.rejected) - rejections} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        mem = ", ".join(f"{b / MIB:.2f}" for b in self.memory_per_ipu)
        budget = ("no budget" if self.memory_budget is None else
                  "budget " + ", ".join(f"{b / MIB:.2f}" for b in self.memory_budget))
        only = ", modeled only: this machine has fewer cores than IPUs" if self.modeled_only \
            else ""
        head = [f"Plan (modeled{only}): {self.summary()}",
                f"  {self.time_per_sample * 1e3:.4f} ms per sample ({self.throughput:.0f} "
                f"samples/s), {self.time_per_call * 1e3:.2f} ms per call",
                f"  peak memory per IPU (MiB): {mem} ({budget})"]
        head += [f"  note: {n}" for n in self.notes]
        return "\n".join(head) + "\n\n" + self.table()

    def to_dict(self) -> Dict[str, Any]:
        return {"blocks": list(self.blocks), "stages": [list(s) for s in self.stages],
                "split": self.split, "stage_ipus": list(self.stage_ipus),
                "schedule": self.schedule, "micro_batch": self.micro_batch,
                "gradient_accumulation": self.gradient_accumulation,
                "device_iterations": self.device_iterations, "recompute": list(self.recompute),
                "time_per_call": self.time_per_call, "time_per_sample": self.time_per_sample,
                "throughput": self.throughput, "memory_per_ipu": list(self.memory_per_ipu),
                "modeled_only": self.modeled_only}


class _RecomputeMark:
    """A forward pre-hook marking the stage being traced for recomputation if it holds one of
    ``blocks``."""

    def __init__(self, blocks) -> None:
        self.blocks = set(blocks)

    def __call__(self, module, args):
        recorder = active_recorder()
        if recorder is not None and recorder.segments \
                and self.blocks.intersection(recorder.segments[-1].blocks):
            recorder.segments[-1].recompute = True


#: The cost table's fields that hold one cost per block (they scale with the micro-batch).
PER_BLOCK = ("forward", "backward", "input_grad", "weight_grad")


def _is_block_list(value, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and \
        all(isinstance(v, (int, float)) for v in value)


def table_at(tables: Sequence[CostTable], micro_batch: int) -> CostTable:
    """The cost table at ``micro_batch``: block costs and the host's linear between the two
    tables furthest apart (proportional from one table), the rest as at the largest size."""
    tables = sorted(tables, key=lambda t: t.micro_batch)
    lo, hi = tables[0], tables[-1]
    n = len(hi.blocks)
    changes: Dict[str, Any] = {"micro_batch": int(micro_batch)}
    one = len(tables) == 1 or lo.micro_batch == hi.micro_batch
    r = micro_batch / hi.micro_batch if hi.micro_batch else 1.0
    w = 0.0 if one else (micro_batch - lo.micro_batch) / (hi.micro_batch - lo.micro_batch)

    def lin(a: float, b: float) -> float:
        return float(b) * r if one else max(0.0, float(a) + (float(b) - float(a)) * w)

    for name in PER_BLOCK:
        a, b = getattr(lo, name, None), getattr(hi, name, None)
        if _is_block_list(b, n) and _is_block_list(a, n):
            changes[name] = [lin(x, y) for x, y in zip(a, b)]
    if not one:
        for name in ("host_before", "host_after"):
            changes[name] = lin(getattr(lo, name), getattr(hi, name))
    return dataclasses.replace(hi, **changes)


def with_recompute(table: CostTable, blocks: Sequence[str]) -> CostTable:
    """``table`` with each of ``blocks`` paying its forward again in its backward (and in its
    input-gradient half)."""
    if not blocks:
        return table
    chosen = set(blocks)
    extra = [f if b in chosen else 0.0 for b, f in zip(table.blocks, table.forward)]
    changes = {"backward": [x + e for x, e in zip(table.backward, extra)]}
    if _is_block_list(getattr(table, "input_grad", None), len(table.blocks)):
        changes["input_grad"] = [x + e for x, e in zip(table.input_grad, extra)]
    return dataclasses.replace(table, **changes)


def resized(args: Tuple, micro_batch: int) -> Tuple:
    """``args`` with every batched tensor cut or cycled to ``micro_batch`` rows."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            index = torch.arange(micro_batch, device=a.device) % a.shape[0]
            a = a.index_select(0, index)
        out.append(a)
    return tuple(out)


def measure_block_memory(model: torch.nn.Module, sample_inputs, block_order: Sequence[str],
                         optimizer=None) -> BlockMemory:
    """Bytes per block of ``model`` (one micro-batch = ``sample_inputs``), from a throw-away
    compile with every block a stage of its own; the model is left as it was."""
    args = as_args(sample_inputs)
    order = list(block_order)
    options = Options()
    options.setExecutionStrategy(strategy_for(order, list(range(len(order))), sharded=True))
    params = [p for p in model.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(params or [torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    with training_wrapper_set_aside(model), \
            memory_model.unchanged_state([model], weights=True):
        compiled = trainingModel(model, options, sgd)
        try:
            compiled.compile(*args)
            stages = compiled.program.partition.stages
            weights = {b: 0 for b in order}
            for st in stages:
                own = list({id(p): p for p in st.parameters}.values())
                trainable = [p for p in own if p.requires_grad]
                state = memory_model.optimizer_state_bytes(optimizer, trainable)[0] \
                    if optimizer is not None else 0
                total = memory_model.tensor_bytes(own) + memory_model.tensor_bytes(trainable) \
                    + state
                for b in st.blocks:
                    weights[b] += total // len(st.blocks)
            act = {b: 0.0 for b in order}
            ins = {b: 0.0 for b in order}
            outs = {b: 0.0 for b in order}
            for entry, st in zip(memory_model.stage_tensor_bytes(compiled), stages):
                for b in st.blocks:
                    act[b] += entry["held_bytes"] / len(st.blocks)
                    ins[b] += entry["input_bytes"] / len(st.blocks)
                    outs[b] += entry["output_bytes"] / len(st.blocks)
        finally:
            compiled.destroy()
    return BlockMemory(blocks=order, weights=[weights[b] for b in order],
                       activations=[act[b] for b in order], inputs=[ins[b] for b in order],
                       outputs=[outs[b] for b in order],
                       micro_batch=int(first.shape[0]) if first is not None else 1)


def compositions(num_blocks: int, parts: int) -> List[List[int]]:
    """Every way to cut ``num_blocks`` blocks into ``parts`` non-empty contiguous runs."""
    return [[b - a for a, b in zip((0,) + cuts, cuts + (num_blocks,))]
            for cuts in itertools.combinations(range(1, num_blocks), parts - 1)]


def stages_of(blocks: Sequence[str], split: Sequence[int]) -> List[List[str]]:
    edges = list(itertools.accumulate(split, initial=0))
    return [list(blocks[a:b]) for a, b in zip(edges, edges[1:])]


def stage_placement(kind: str, num_stages: int, ipus: int) -> List[int]:
    if kind == "sharded":
        return list(range(num_stages))
    return placement(kind, num_stages, ipus if KINDS_BY_NAME[kind].placement == "loop" else None)


def _stage_count(kind: str, ipus: int) -> int:
    return ipus if KINDS_BY_NAME[kind].placement == "line" else 2 * ipus


def _bottleneck(table: CostTable, split: Sequence[int], stage_ipus: Sequence[int]) -> float:
    per_block = [f + b for f, b in zip(table.forward, table.backward)]
    ipu_of = [stage_ipus[s] for s, n in enumerate(split) for _ in range(n)]
    return max(stage_totals(per_block, ipu_of))


def _activation_peaks(schedule, stage_bytes: Sequence[float], ipus: int) -> List[float]:
    """The most activation bytes each IPU holds at once over ``schedule``'s order."""
    stage_ipus = list(schedule.stage_ipus)
    if len(set(stage_ipus)) == len(stage_ipus):   # one stage per IPU: viz.memory's count
        stash = memory_model.stash_of(schedule)
        peaks = [0.0] * ipus
        for s, n in enumerate(stash):
            peaks[stage_ipus[s]] = n * stage_bytes[s]
        return peaks
    peaks = [0.0] * ipus
    for lane in schedule.lanes:
        held = peak = 0.0
        for a in lane:
            if a.kind == FORWARD:
                held += stage_bytes[a.stage]
                peak = max(peak, held)
            elif a.kind in (BACKWARD, WEIGHT_GRAD):
                held -= stage_bytes[a.stage]
        ipus_here = {stage_ipus[a.stage] for a in lane if a.stage >= 0}
        for i in ipus_here:
            peaks[i] = max(peaks[i], peak)
    return peaks


@dataclass
class _Candidate:
    kind: str
    split: List[int]
    stage_ipus: List[int]
    micro_batch: int
    ga: int
    recompute: List[int]
    time_per_call: float = 0.0
    memory: List[int] = field(default_factory=list)


class Planner:
    """The search behind :func:`plan`, on given costs and block memory (no measuring)."""

    def __init__(self, tables: Sequence[CostTable], memory: BlockMemory, ipus: int,
                 global_batch: int, memory_budget=None, micro_batch_sizes=None,
                 schedules=None, split=None, recompute=None, device_iterations: int = 1,
                 splits_kept: int = SPLITS_KEPT, together: Sequence[Sequence[str]] = ()) -> None:
        self.tables = list(tables)
        self.blocks = list(self.tables[0].blocks)
        self.memory = memory
        self.ipus = int(ipus)
        self.global_batch = int(global_batch)
        self.device_iterations = int(device_iterations)
        self.splits_kept = splits_kept
        self.recompute = recompute
        self.kinds = resolve_schedules(schedules)
        self.micro_batches = micro_batch_candidates(self.global_batch, micro_batch_sizes)
        self.split = None if split is None else [int(n) for n in split]
        n = len(self.blocks)
        index = {b: i for i, b in enumerate(self.blocks)}
        unknown = [b for group in together for b in group if b not in index]
        if unknown:
            raise OptionsError(f"ipukit.plan(together=...): {unknown} are not blocks of the "
                               f"model {self.blocks}.")
        #: the block indices of each group that must share a stage
        self.together = [sorted(index[b] for b in group) for group in together if len(group) > 1]
        if isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool):
            self.budget: Optional[List[int]] = [int(memory_budget)] * self.ipus
        elif memory_budget is None:
            self.budget = None
        else:
            self.budget = [int(b) for b in memory_budget]
            if len(self.budget) != self.ipus:
                raise OptionsError(f"ipukit.plan(memory_budget={memory_budget}): one budget per "
                                   f"IPU ({self.ipus}) or a single number of bytes.")
        if self.split is not None and (sum(self.split) != n or min(self.split) < 1):
            raise OptionsError(f"ipukit.plan(split={self.split}): the model has {n} blocks "
                               f"{self.blocks}; give blocks per stage, each >= 1, summing to {n}.")
        self._tables: Dict[int, CostTable] = {}
        self._memory: Dict[int, BlockMemory] = {}

    def table(self, micro_batch: int) -> CostTable:
        if micro_batch not in self._tables:
            self._tables[micro_batch] = table_at(self.tables, micro_batch)
        return self._tables[micro_batch]

    def block_memory(self, micro_batch: int) -> BlockMemory:
        if micro_batch not in self._memory:
            self._memory[micro_batch] = self.memory.scaled(micro_batch)
        return self._memory[micro_batch]

    # -- one candidate -------------------------------------------------------------------
    def model_time(self, c: _Candidate) -> float:
        table = self.table(c.micro_batch)
        stages = stages_of(self.blocks, c.split)
        table = with_recompute(table, [b for s in c.recompute for b in stages[s]])
        ipus = None if c.kind == "sharded" else c.stage_ipus
        one = model_call(table, c.kind, stages, c.ga, iterations=1, stage_ipus=ipus).wall_time
        if self.device_iterations <= 1:
            return one
        two = model_call(table, c.kind, stages, c.ga, iterations=2, stage_ipus=ipus).wall_time
        return one + (two - one) * (self.device_iterations - 1)

    def model_memory(self, c: _Candidate) -> List[int]:
        mem = self.block_memory(c.micro_batch)
        index = {b: i for i, b in enumerate(self.blocks)}
        stages = stages_of(self.blocks, c.split)
        stage_bytes, weights = [], [0] * self.ipus
        # while a backward runs it holds, beside the stash, the gradients of its micro-batch's
        # activations (about as large as they are); a recomputing one first rebuilds those
        # activations too: the largest such pass of each IPU
        transient = [0.0] * self.ipus
        for s, names in enumerate(stages):
            first, last = index[names[0]], index[names[-1]]
            stage_bytes.append(mem.stage_activation(first, last, s in c.recompute))
            weights[c.stage_ipus[s]] += sum(mem.weights[first:last + 1])
            whole = mem.stage_activation(first, last, False) * (2 if s in c.recompute else 1)
            ipu = c.stage_ipus[s]
            transient[ipu] = max(transient[ipu], whole)
        schedule = build(c.kind, len(stages), c.ga, 1,
                         None if c.kind == "sharded" else c.stage_ipus)
        peaks = _activation_peaks(schedule, stage_bytes, self.ipus)
        return [int(w + a + t) for w, a, t in zip(weights, peaks, transient)]

    def over(self, memory: Sequence[int]) -> Dict[int, int]:
        if self.budget is None:
            return {}
        return {i: int(m - b) for i, (m, b) in enumerate(zip(memory, self.budget)) if m > b}

    # -- the search ----------------------------------------------------------------------
    def keeps_together(self, split: Sequence[int]) -> bool:
        """Whether ``split`` leaves each of the ``together`` groups in one stage."""
        stage = [s for s, n in enumerate(split) for _ in range(n)]
        return all(stage[g[0]] == stage[g[-1]] for g in self.together)

    def splits_for(self, kind: str, micro_batch: int) -> List[List[int]]:
        S = _stage_count(kind, self.ipus)
        if self.split is not None:
            return [self.split] if len(self.split) == S and self.keeps_together(self.split) \
                else []
        every = [sp for sp in compositions(len(self.blocks), S) if self.keeps_together(sp)]
        if len(every) <= self.splits_kept:
            return every
        table = self.table(micro_batch)
        ipus = stage_placement(kind, S, self.ipus)
        even = [len(s) for s in even_split(self.blocks, S)]
        ranked = sorted(every, key=lambda sp: (_bottleneck(table, sp, ipus), sp))
        keep = ranked[:self.splits_kept]
        return keep + ([even] if even not in keep and even in every else [])

    def run(self) -> Tuple[List[_Candidate], List[Rejection], List[_Candidate]]:
        fits: List[_Candidate] = []
        rejected: List[Rejection] = []
        over_budget: List[_Candidate] = []
        n = len(self.blocks)
        for kind in self.kinds:
            S = _stage_count(kind, self.ipus)
            for m in self.micro_batches:
                ga = self.global_batch // m
                if S > n:
                    rejected.append(Rejection(kind, m, ga, (
                        f"needs {S} stages ({S // self.ipus} per IPU) but the model has {n} "
                        f"blocks")))
                    continue
                if self.split is not None and len(self.split) != S:
                    rejected.append(Rejection(kind, m, ga, (
                        f"needs {S} stages; split={self.split} gives {len(self.split)}"),
                        split=self.split))
                    continue
                if self.split is not None and not self.keeps_together(self.split):
                    rejected.append(Rejection(kind, m, ga, (
                        f"split={self.split} cuts a group of blocks that must share a stage "
                        f"(together={[[self.blocks[i] for i in g] for g in self.together]})"),
                        split=self.split))
                    continue
                least = 1 if kind == "sharded" else minimum_micro_batches(kind, S, self.ipus)
                if ga < least:
                    rejected.append(Rejection(kind, m, ga, (
                        f"too few micro-batches for the schedule: gradient accumulation {ga} < "
                        f"{least}, the fewest {title_of(kind)} runs with on {S} stages; use a "
                        f"micro-batch of at most {self.global_batch // least}")))
                    continue
                ipus = stage_placement(kind, S, self.ipus)
                try:
                    build(kind, S, ga, 1, None if kind == "sharded" else ipus)
                except (ScheduleError, ValueError) as exc:
                    rejected.append(Rejection(kind, m, ga, f"schedule cannot be built: {exc}"))
                    continue
                for sp in self.splits_for(kind, m):
                    self._consider(_Candidate(kind, sp, ipus, m, ga, []), fits, rejected,
                                   over_budget)
        fits.sort(key=_rank)
        return fits, rejected, over_budget

    def _consider(self, c: _Candidate, fits, rejected, over_budget) -> None:
        S = len(c.split)
        variants = [list(range(S))] if self.recompute is True else [[]]
        for rc in variants:
            c = dataclasses.replace(c, recompute=rc)
            c.memory = self.model_memory(c)
            over = self.over(c.memory)
            if over and self.recompute is None and not rc:
                # recompute the stages of the IPUs over budget, then every stage
                hot = [s for s in range(S) if c.stage_ipus[s] in over]
                for more in (hot, list(range(S))):
                    if more and more not in variants:
                        variants.append(more)
            if over:
                worst = max(over, key=over.get)
                rejected.append(Rejection(
                    c.kind, c.micro_batch, c.ga,
                    f"over budget on IPU {worst} by {over[worst]:,} bytes "
                    f"({over[worst] / MIB:.2f} MiB; needs {c.memory[worst]:,})",
                    split=c.split, recompute=rc, over_budget=over))
                over_budget.append(c)
            else:
                c.time_per_call = self.model_time(c)
                fits.append(c)


def _rank(c: _Candidate):
    per_sample = c.time_per_call / (c.micro_batch * c.ga)
    order = [k.name for k in PIPELINED] + ["sharded"]
    return (round(per_sample, 15), max(c.memory), order.index(c.kind), c.split,
            -c.micro_batch, c.recompute)


def resolve_schedules(schedules) -> List[str]:
    if schedules is None:
        return [k.name for k in PIPELINED]
    if isinstance(schedules, str):
        schedules = [schedules]
    out = []
    for name in schedules:
        kind = kind_of(name)
        if kind is None or "inference" in kind:
            choices = [k.title for k in PIPELINED] + ["Sharded"]
            raise OptionsError(f"ipukit.plan(schedules=[..., {name!r}, ...]): not a training "
                               f"schedule; use any of {choices}.")
        out.append(kind)
    return out


def micro_batch_candidates(global_batch: int, sizes=None, most: int = 6) -> List[int]:
    """The micro-batch sizes to try: ``sizes`` that divide ``global_batch``, or by default
    up to ``most`` of its divisors spread evenly on a log scale (accumulation 1 to 64)."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise OptionsError(f"ipukit.plan(global_batch={global_batch!r}): the samples per "
                           "optimiser step must be an int >= 1.")
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    if sizes is not None:
        sizes = sorted({int(s) for s in ([sizes] if isinstance(sizes, int) else sizes)})
        good = [s for s in sizes if s >= 1 and global_batch % s == 0]
        if not good:
            raise OptionsError(
                f"ipukit.plan(global_batch={global_batch}, micro_batch_sizes={sizes}): no "
                f"micro-batch size divides the global batch; use micro-batch sizes among its "
                f"divisors {divisors}, or a global batch that is a multiple of one of {sizes}.")
        return good
    pool = [d for d in divisors if global_batch // d <= 64]
    if len(pool) <= most:
        return pool
    picks = {pool[round(i * (len(pool) - 1) / (most - 1))] for i in range(most)}
    return sorted(picks)


def _plan_of(c: _Candidate, blocks, planner: Planner, modeled_only: bool, notes) -> Plan:
    return Plan(blocks=list(blocks), stages=stages_of(blocks, c.split),
                stage_ipus=list(c.stage_ipus), schedule=c.kind, micro_batch=c.micro_batch,
                gradient_accumulation=c.ga, device_iterations=planner.device_iterations,
                recompute=list(c.recompute), time_per_call=c.time_per_call,
                memory_per_ipu=list(c.memory), ipus=planner.ipus,
                memory_budget=planner.budget, modeled_only=modeled_only, notes=list(notes))


def search(planner: Planner, modeled_only: bool = False, notes: Sequence[str] = ()) -> Plan:
    """Run ``planner`` and return the best plan (with alternatives and rejections), or
    raise naming the smallest budget that fits / the setting that makes no plan possible."""
    started = time.perf_counter()
    fits, rejected, over = planner.run()
    if not fits:
        if over:
            # the smallest peak any candidate needs (time it: the error names that plan)
            best = min(over, key=lambda c: (max(c.memory), c.kind, c.split, c.micro_batch,
                                            c.recompute))
            best.time_per_call = planner.model_time(best)
            plan = _plan_of(best, planner.blocks, planner, modeled_only, notes)
            budget = planner.budget
            shown = budget[0] if budget and len(set(budget)) == 1 else budget
            raise OptionsError(
                f"ipukit.plan(memory_budget={shown}): no plan fits on {planner.ipus} IPUs. "
                f"The smallest budget that fits is {plan.peak_memory:,} bytes "
                f"({plan.peak_memory / MIB:.2f} MiB) per IPU, reached by {plan.summary()}. "
                "Raise memory_budget to at least that, use more IPUs, or lower global_batch.")
        reasons = sorted({r.reason for r in rejected})
        raise PipelineConfigError(
            f"ipukit.plan(ipus={planner.ipus}, global_batch={planner.global_batch}, "
            f"schedules={[title_of(k) for k in planner.kinds]}): no candidate is possible: "
            + "; ".join(reasons[:4]) + ". Raise global_batch (more micro-batches per step), "
            "allow smaller micro_batch_sizes, or allow other schedules.")
    plans = [_plan_of(c, planner.blocks, planner, modeled_only, notes) for c in fits]
    best = plans[0]
    best.alternatives = plans
    best.rejected = rejected
    best.planning_seconds = time.perf_counter() - started
    return best


def plan(model: torch.nn.Module, sample_inputs, ipus: int, global_batch: int,
         memory_budget: Union[None, int, Sequence[int]] = None, *,
         split: Union[None, str, Sequence[int]] = None, schedules=None,
         micro_batch_sizes=None, recompute: Optional[bool] = None, device_iterations: int = 1,
         optimizer=None, costs: Union[None, CostTable, Sequence[CostTable]] = None,
         memory: Optional[BlockMemory] = None, block_order: Optional[Sequence[str]] = None,
         repeats: int = 8, cache_dir: Optional[str] = None,
         together: Sequence[Sequence[str]] = ()) -> Plan:
    """The fastest modeled plan for training ``model`` on ``ipus`` virtual IPUs.

    ``sample_inputs``: a batch of the model's arguments (labels included; its rows are
    cut or cycled to each micro-batch size). ``global_batch``: samples per optimiser step
    (micro-batch × gradient accumulation). ``memory_budget``: bytes per IPU (one number, or
    one per IPU; None: no limit). ``split``: None or ``"auto"`` searches the splits; a
    ``layers_per_ipu``-style list of blocks per stage fixes it. ``schedules``: the kinds
    to try (default every pipelined one). ``micro_batch_sizes``: those to try (default: up
    to six divisors of ``global_batch``). ``recompute``: None tries recomputation where the
    budget needs it, True always, False never. ``optimizer``: the training's optimiser
    (its state counts in memory, its step in time). ``costs`` / ``memory``: skip the
    measuring (a :class:`CostTable` or several at different micro-batch sizes, a
    :class:`BlockMemory`). ``together``: groups of blocks that must share a stage (a ViT's
    final norm and classifier, which its ``parallelize`` puts on the last IPU); splits that
    cut one are not tried.

    Returns the best :class:`Plan`; ``plan.alternatives`` ranks every plan that fits,
    ``plan.rejected`` says why the others do not; ``plan.apply(model)`` gives the
    ``ipukit.Options`` to run it. Raises ``ipukit.OptionsError`` naming the smallest
    budget that fits when none does, ``PipelineConfigError`` for impossible settings.
    """
    started = time.perf_counter()
    if isinstance(model, PoplarExecutor):
        model = model.model
    if not isinstance(ipus, int) or isinstance(ipus, bool) or ipus < 1:
        raise OptionsError(f"ipukit.plan(ipus={ipus!r}): the number of virtual IPUs must be an "
                           "int >= 1.")
    args = as_args(sample_inputs)
    if isinstance(costs, CostTable):
        costs = [costs]
    order = list(block_order) if block_order is not None else (
        list(costs[0].blocks) if costs else discover_blocks(model, args))
    if not order:
        raise PipelineConfigError("ipukit.plan(): the model entered no Block; annotate it with "
                                  "ipukit.Block(...) / ipukit.BeginBlock(...) first.")
    if ipus > len(order):
        raise PipelineConfigError(
            f"ipukit.plan(ipus={ipus}): the model has only {len(order)} blocks {order}, and "
            f"every IPU needs at least one; use ipus <= {len(order)} or annotate more Blocks.")
    if isinstance(split, str):
        if split != "auto":
            raise OptionsError(f"ipukit.plan(split={split!r}): use None or 'auto' to search, or "
                               "a list of blocks per stage such as [2, 2].")
        split = None
    sizes = micro_batch_candidates(global_batch, micro_batch_sizes)
    notes: List[str] = []
    if costs is None:
        measured = sorted({sizes[0], sizes[-1]})
        costs = [calibrate(model, resized(args, m), block_order=order, repeats=repeats,
                           cache_dir=cache_dir, optimizer=optimizer) for m in measured]
        notes.append("costs calibrated at micro-batch " + " and ".join(map(str, measured))
                     + (", interpolated linearly (fixed + per sample) between them"
                        if len(measured) > 1 else ""))
    elif len(costs) == 1:
        notes.append(f"one cost table (micro-batch {costs[0].micro_batch}): block costs "
                     "taken as proportional to the micro-batch size")
    if memory is None:
        memory = measure_block_memory(model, resized(args, sizes[-1]), order, optimizer)
        notes.append(f"activations measured at micro-batch {sizes[-1]}, scaled in "
                     "proportion to the micro-batch size")
    notes += memory.notes
    planner = Planner(costs, memory, ipus, global_batch, memory_budget, sizes, schedules,
                      split, recompute, device_iterations, together=together)
    devices = torch.cuda.device_count() if any(
        p.is_cuda for p in model.parameters()) else available_cores()
    modeled_only = ipus > devices
    if modeled_only:
        notes.append(f"modeled only: {ipus} IPUs but this machine runs {devices} at once")
    best = search(planner, modeled_only, notes)
    best.planning_seconds = time.perf_counter() - started
    return best
