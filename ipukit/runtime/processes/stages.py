"""ipukit's stages as torch.distributed.pipelining sees them, and the schedule that runs them.

* :class:`StageBody`: one ipukit stage as a module of received tensors in,
  tensors to send out (model inputs read from the call's micro-batch, skip
  connections carried through the stages in between);
* :func:`timed_stage_class`: torch's ``PipelineStage`` that tells its body
  which micro-batch runs and records measured spans;
* :func:`torch_schedule` / :func:`runtime_class`: torch's own schedule class
  where it runs exactly ipukit's order, else torch's schedule runtime fed
  ipukit's actions.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from ..._torch import hooked_stage_class, load_actions, mapped_runtime_class
from ...schedules.registry import PIPELINED


class CallContext:
    """What this process's stage bodies and stages read and write during a call."""

    def __init__(self, returned: List[bool], span: Callable[[int, str, int, Any], None],
                 start: Callable[[], Any] = time.perf_counter) -> None:
        self.inputs: List[list] = []        # this iteration's micro-batches (flat model inputs)
        self.rows: Dict[int, Dict[int, Any]] = {}   # micro-batch → {output index: value}
        self.iteration = 0
        self.micro_batch = 0
        self.offset = 0                     # micro-batch index of this iteration's first
        self.returned = returned            # which micro-batches' outputs the output mode keeps
        self.span = span                    # records (stage, kind, micro-batch, start) → now
        self.start = start                  # an action's start (host time, or a CUDA event)
        #: (stage, micro-batch) of the first iteration's forward after which ``idle`` runs
        self.idle_after: Any = None
        self.idle: Callable[[], None] = lambda: None
        #: actions completed in this call (the watchdog reads it), and the error that
        #: stops the call at the next action's end once the watchdog has fired
        self.done = 0
        self.stop: Any = None

    def forwarded(self, stage: int, micro_batch: int) -> None:
        """A forward ended: run ``idle`` if it was the one named by ``idle_after``."""
        if self.idle_after == (stage, micro_batch) and self.iteration == 0:
            self.idle()


class StageBody(torch.nn.Module):
    """One ipukit stage as torch's pipeline sees it: tensors carried from the previous stage in,
    tensors to send out; model inputs are read from the call's micro-batch, and the last stage
    returns the loss.
    """

    def __init__(self, compiled, ctx: CallContext, index: int, carried_in: List[Tuple[int, int]],
                 carried_out: List[Tuple[int, int]], device: torch.device) -> None:
        super().__init__()
        st = compiled.partition.stages[index]
        self.inner = st.module
        self._ctx = ctx
        self._index = index
        self._args = st.args
        self._tuple_output = st.tuple_output
        self._tensor_inputs = list(compiled.tensor_inputs)
        self._carried_in = carried_in
        self._carried_out = carried_out
        self._host_outputs = compiled.host_outputs[index]
        self._last = index == compiled.partition.num_stages - 1
        self._loss_item = compiled.loss_item if compiled.training else None
        self._device = device

    def forward(self, *carried):
        ctx = self._ctx
        k = ctx.micro_batch
        inputs = ctx.inputs[k]
        values = dict(zip(self._carried_in, carried))
        args = []
        for ref in self._args:
            if ref.kind == "input":
                v = inputs[self._tensor_inputs[ref.index]]
                if isinstance(v, torch.Tensor) and v.device != self._device:
                    v = v.to(self._device)
            elif ref.kind == "stage":
                v = values[(ref.index, 0 if ref.item is None else ref.item)]
            else:
                v = ref.value
            args.append(v)
        out = self.inner(*args)
        outs = out if self._tuple_output else (out,)
        if self._host_outputs and ctx.returned[ctx.offset + k]:
            row = ctx.rows.setdefault(ctx.offset + k, {})
            for j, item in self._host_outputs:
                v = outs[item]
                row[j] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
        if self._last:
            if self._loss_item is not None:
                return outs[self._loss_item]
            return torch.zeros((), device=self._device)
        mine = {(self._index, i): v for i, v in enumerate(outs)}
        sent = []
        for key in self._carried_out:
            v = mine[key] if key in mine else values[key]
            if isinstance(v, torch.Tensor) and (key not in mine or v._is_view()):
                # a tensor of its own: one carried through gets a new autograd node (gradients
                # flow back through it), and torch's split backward (I) detaches the outputs
                # in place, which it cannot do to a view
                v = v.clone()
            sent.append(v)
        return tuple(sent)


def carry_plan(partition) -> List[List[Tuple[int, int]]]:
    """carried[s] = the (stage, item) tensors stage s receives from stage s - 1, in order."""
    n = partition.num_stages
    last_use: Dict[Tuple[int, int], int] = {}
    for st in partition.stages:
        for ref in st.args:
            if ref.kind == "stage":
                key = (ref.index, 0 if ref.item is None else ref.item)
                last_use[key] = max(last_use.get(key, -1), st.index)
    carried = [[] for _ in range(n)]
    for s in range(1, n):
        carried[s] = sorted(key for key, used in last_use.items() if key[0] < s <= used)
    return carried


def timed_stage_class():
    """torch's ``PipelineStage``, telling its body the micro-batch and recording the measured spans
    of F, B, I and W (shape inference under DDP in ``no_sync``).
    """
    from .replicas import without_sync

    class TimedStage(hooked_stage_class()):
        def around_shape_inference(self):
            # torch infers the stage's shapes at the first step by running its module once,
            # outside the schedule's no_sync: under DDP, without sync too (replicas.without_sync)
            return without_sync(self.submod)

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            ctx = self._ipukit_ctx
            ctx.micro_batch = fwd_chunk_id
            start = ctx.start()
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            ctx.span(self.stage_index, "F", fwd_chunk_id, start)
            ctx.done += 1
            if ctx.stop is not None:
                raise ctx.stop
            ctx.forwarded(self.stage_index, fwd_chunk_id)
            return out

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                               last_backward=False):
            start = self._ipukit_ctx.start()
            out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                             last_backward=last_backward)
            ctx = self._ipukit_ctx
            ctx.span(self.stage_index, "B" if full_backward else "I", bwd_chunk_id, start)
            ctx.done += 1
            if ctx.stop is not None:
                raise ctx.stop
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            start = self._ipukit_ctx.start()
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            ctx = self._ipukit_ctx
            ctx.span(self.stage_index, "W", bwd_chunk_id, start)
            ctx.done += 1
            if ctx.stop is not None:
                raise ctx.stop
            return out

    return TimedStage


def receive_buffers(stages: Sequence) -> List[torch.Tensor]:
    """What torch's ``PipelineStage`` keeps between steps to receive into: a buffer per
    micro-batch for each input activation and output gradient, and the input gradients a split
    backward leaves in their ``.grad``. A measured process counts them in its baseline.
    """
    out = []
    for stage in stages:
        for infos in (stage.args_recv_info, stage.grad_recv_info):
            for recv in infos.values():
                for info in recv:
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor):
                        out.append(buffer)
                        if buffer.grad is not None:
                            out.append(buffer.grad)
    return out


def torch_single_order(kind: str, stage: int, num_stages: int, micro_batches: int) -> List[str]:
    """The order torch's ``Schedule1F1B``/``ScheduleGPipe`` run one stage's actions in (as their
    ``_step_microbatches`` execute it).
    """
    M = micro_batches
    if kind == "gpipe":
        return [f"{stage}F{m}" for m in range(M)] + [f"{stage}B{m}" for m in range(M)]
    warmup = min(M, num_stages - stage)
    order = [f"{stage}F{m}" for m in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        order.append(f"{stage}B{bwd}")
        bwd += 1
        if fwd == M:
            break
        order.append(f"{stage}F{fwd}")
        fwd += 1
    order += [f"{stage}B{m}" for m in range(bwd, M)]
    return order


def _torch_schedule(kind: str, training: bool, stages: list, num_stages: int, lanes,
                    micro_batches: int, loss_fn):
    """torch's own schedule class when it runs exactly ipukit's order (1F1B or GPipe with one stage
    per process), else None.
    """
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}.get(kind)
    n = num_stages
    if cls is None or not training or len(stages) != 1 or len(lanes) != n:
        return None
    ours = [[str(a) for a in lane] for lane in lanes]
    if any(ours[s] != torch_single_order(kind, s, n, micro_batches) for s in range(n)):
        return None
    return cls(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)


#: torch's classes of ipukit's modern schedules (several stages per process); ipukit's action
#: lists equal theirs for the sizes torch supports (tests/test_schedules.py), and each is
#: checked again before it runs.
#: torch's classes for the kinds with several stages per process (a loop or a V).
_TORCH_MULTI = {k.name: k.torch_class for k in PIPELINED if k.placement in ("loop", "v")}


def _compute_actions(order) -> List[str]:
    """torch's per-rank list as compute actions only: empty slots dropped, an OVERLAP_F_B pair
    as its forward then its backward (as torch's runtime runs it)."""
    out = []
    for a in order:
        if a is None:
            continue
        kind = a.computation_type.value
        if kind == "OVERLAP_F_B":
            out += [str(sub) for sub in a.sub_actions]
        elif kind in ("F", "B", "I", "W"):
            out.append(str(a))
    return out


def _torch_multi_schedule(kind: str, training: bool, stages: list, lanes, micro_batches: int,
                          loss_fn):
    """torch's own class of a modern schedule when its per-rank actions are exactly ipukit's
    lanes, else None (ipukit's actions then run on torch's runtime)."""
    from torch.distributed.pipelining import schedules

    name = _TORCH_MULTI.get(kind)
    if name is None or not training:
        return None
    try:
        runner = getattr(schedules, name)(stages, micro_batches, loss_fn=loss_fn,
                                          scale_grads=False)
    except Exception:  # noqa: BLE001 - torch refuses this size or placement
        return None
    theirs = {rank: _compute_actions(order) for rank, order in runner.pipeline_order.items()}
    ours = {rank: [str(a) for a in lane] for rank, lane in enumerate(lanes)}
    return runner if theirs == ours else None


def schedule_runner(schedule, training: bool, stages: list, stage_rank: Dict[int, int],
                    lanes: List[list], loss_fn):
    """What runs one iteration of ``schedule`` on this process's ``stages``: torch's own class where
    it runs exactly ipukit's order, else torch's ``_PipelineScheduleRuntime`` fed ipukit's
    ``lanes`` (one per pp rank) with the stage → rank mapping ``stage_rank``.
    """
    M = schedule.micro_batches
    runner = (_torch_schedule(schedule.kind, training, stages, len(stage_rank), lanes, M, loss_fn)
              or _torch_multi_schedule(schedule.kind, training, stages, lanes, M, loss_fn))
    if runner is not None:
        return runner
    runner = mapped_runtime_class()(stages, M, loss_fn=loss_fn if training else None,
                                    scale_grads=False)
    runner.stage_rank = dict(stage_rank)
    load_actions(runner, {r: [str(a) for a in lane] for r, lane in enumerate(lanes)})
    return runner


def process_lanes(schedule, ipus: Sequence[int]) -> List[list]:
    """One iteration's compute actions per virtual IPU (pp rank), in the order each runs them.

    A one-lane (sharded) schedule becomes one lane per virtual IPU, in the same order.
    """
    if sorted(schedule.lane_ipus, key=str) == sorted(ipus, key=str):  # a lane per virtual IPU
        by_ipu = dict(zip(schedule.lane_ipus, schedule.iteration_lanes(0)))
        return [list(by_ipu[ipu]) for ipu in ipus]
    lanes = [[] for _ in ipus]
    where = {ipu: k for k, ipu in enumerate(ipus)}
    for lane in schedule.lanes:
        for a in lane:
            if a.iteration == 0 and a.kind != "S":
                lanes[where[schedule.stage_ipus[a.stage]]].append(a)
    return lanes
