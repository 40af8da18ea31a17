"""The single-thread backward: one autograd pass for every stage of a micro-batch.

When one thread runs every stage of a micro-batch in turn, the stages' graphs stay connected
and one backward serves them all, as in a plain loop (hooks at the stage boundaries keep one
backward span per stage on the timeline). A chained lane (a sharded call) goes further with
:class:`Chain`.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import List, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from .._torch import direct_forward
from ..schedules.ir import Action
from ..timeline.events import Event
from . import update
from .contract import action_note


class FusedBackward:
    """The last stage's backward runs every stage's; the others report their share."""

    def __init__(self, runner) -> None:
        self.runner = runner
        plan = runner.plan
        self.params = [p for params in plan.trainable for p in params]
        # With no replica or anchor to tell micro-batches apart, the pass accumulates
        # straight into ``p.grad`` (autograd reuses those buffers instead of allocating
        # fresh gradients every micro-batch, as a plain loop does); float32 weights only,
        # so half-precision gradients still accumulate in float32.
        self.grads_in_params = (runner.replicas == 1 and runner.anchors is None and
                                all(p.dtype == torch.float32 for p in self.params))
        #: each parameter once (stages may share one): what the step scales and steps in place
        self.unique_params = list({id(p): p for p in self.params}.values())

    @staticmethod
    def timer(stash: dict, a: Action):
        """A hook noting when the gradient reaching stage ``a.stage``'s input is ready."""
        def hook(grad):
            stash[("grad-ready", a.stage, a.iteration, a.micro_batch)] = time.perf_counter()
        return hook

    def __call__(self, a: Action, replica: int, stash: dict) -> Tuple[float, float]:
        key = (a.iteration, a.micro_batch)
        span = stash.pop(("span", a.stage) + key, None)
        if span is not None:
            return span
        runner, plan = self.runner, self.runner.plan
        n = plan.partition.num_stages
        outs = {s: stash.pop((s,) + key)[1] for s in range(n)}
        start = time.perf_counter()
        loss = plan.loss_of(outs[plan.loss_stage])
        params = self.params
        seed = None if loss is None else [torch.full_like(loss, runner.loss_scaling)]
        if loss is not None and params and self.grads_in_params:
            torch.autograd.backward([loss], seed, inputs=params)
        else:
            result = (torch.autograd.grad([loss], params, seed, allow_unused=True)
                      if loss is not None and params else [None] * len(params))
            first = 0
            for s in range(n):
                count = len(plan.trainable[s])
                runner.accumulate(a._replace(stage=s), replica, plan.trainable[s],
                                  result[first:first + count])
                first += count
        if plan.record and params and params[0].device.type == "cuda":
            torch.cuda.synchronize(params[0].device)  # one pass for every stage: time its work
        end = time.perf_counter()
        for s in reversed(range(n)):  # stage s ran from its successor's input gradient to its own
            began = stash.pop(("grad-ready", s + 1) + key, start) if s < n - 1 else start
            done = stash.get(("grad-ready", s) + key, end) if s > 0 else end
            stash[("span", s) + key] = (began, max(began, done))
        return stash.pop(("span", a.stage) + key)

    def start(self) -> None:
        """Before the call: the pass adds into ``p.grad``, so start from none."""
        if self.grads_in_params:
            for p in self.params:
                p.grad = None


_ACTION_BY_ACTION = threading.local()


def by_action() -> bool:
    """Whether calls on this thread run action by action (:func:`action_by_action`)."""
    return getattr(_ACTION_BY_ACTION, "on", False)


@contextmanager
def action_by_action():
    """Calls on this thread run action by action (never as a :class:`Chain` nor one fused
    backward), each pass timed on its own with the bookkeeping a pipelined call's passes pay:
    what :func:`ipukit.calibrate` measures.
    """
    previous = getattr(_ACTION_BY_ACTION, "on", False)
    _ACTION_BY_ACTION.on = True
    try:
        yield
    finally:
        _ACTION_BY_ACTION.on = previous


class Chain:
    """A chained lane (:attr:`~ipukit.schedules.ir.Schedule.chained`) run as a plain loop runs it.

    For each micro-batch every stage's module runs in turn, each output handed straight on, then
    one ``backward()`` from the loss adds its gradients into ``p.grad``, seeded with the step's
    gradient scale (as a plain loop's ``(loss / accumulation).backward()``; with loss scaling,
    the loss scaling, and the step unscales). The weights after the call are the
    action-by-action path's up to rounding.

    The timeline: each forward between two clock readings, and each micro-batch's whole
    backward between two. Gradient hooks at the stage boundaries cost time, so only one
    micro-batch in :attr:`SAMPLE` is hooked; the others split their measured backward in the
    proportions the hooked ones measured.
    """

    SAMPLE = 16  #: hook the stage boundaries of every SAMPLE-th micro-batch of a lane

    def __init__(self, runner) -> None:
        self.runner = runner
        plan = runner.plan
        self.n = n = plan.partition.num_stages
        self.params = runner.fused.params
        scale = update.gradient_scale(plan.reduction, runner.micro_batches * runner.replicas,
                                      runner.loss_scaling)
        folded = runner.loss_scaling == 1.0
        #: the backward's seed, and what the step still multiplies the gradients by
        self.seed_value = scale if folded else runner.loss_scaling
        self.step_scale = 1.0 if folded else scale
        first_row = runner.micro_inputs[0] if runner.micro_inputs else []
        # what depends on the program and where its inputs lie only: worked out once
        key = tuple((v.device, v.requires_grad) if isinstance(v, torch.Tensor) else None
                    for v in first_row)
        parts = plan.runtime_cache.get(("chain", key))
        if parts is None:
            parts = plan.runtime_cache[("chain", key)] = self._parts(plan, first_row)
        layout, others = parts
        # backward goes without ``inputs=`` where only the trainable parameters want a
        # gradient (no input, constant, buffer or parameter left out of plan.trainable)
        self.named_inputs = any(t.requires_grad for t in others) or any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in first_row)
        self.record = plan.record
        # on a GPU a reading is a CUDA event on the stages' one device (see :meth:`fits`),
        # turned into a time when the timeline is built: no wait for the GPU in the call
        gpu = [d for d in {plan.device_of(s) for s in range(n)} if d.type == "cuda"] \
            if plan.record else []
        gpu_clock = runner.clock  # (the timeline keeps only the clock, not the call's runner)
        self.clock = (lambda: gpu_clock.mark(gpu[0])) if gpu else time.perf_counter
        self.seconds = (lambda e: gpu_clock.seconds(gpu[0], e)) if gpu else None
        self.marks: List = [None] * n  # per stage: when the gradient reached its input
        #: per micro-batch: (its first action, forward clock readings, backward end, the
        #: stages' marks when it was hooked, else None)
        self.records: list = []
        #: per stage: (its forward, where each argument comes from, tuple output, the module
        #: when it recomputes, its outputs the host keeps)
        self.stages = [(direct_forward(module), sources, tuple_output, recompute, host)
                       for module, sources, tuple_output, recompute, host in layout]

    @staticmethod
    def _parts(plan, first_row) -> tuple:
        """Per stage: its module, its arguments' sources, its outputs, and the tensors besides the
        trainable parameters that could want a gradient.
        """
        layout, others = [], []
        wanted = {id(p) for params in plan.trainable for p in params}
        for st in plan.partition.stages:
            device, sources = plan.device_of(st.index), []
            for ref in st.args:
                if ref.kind == "input":
                    i = plan.tensor_inputs[ref.index]
                    # every micro-batch of an input lies where its first does
                    move = i < len(first_row) and first_row[i].device != device
                    sources.append((3, (i, device)) if move else (0, i))
                elif ref.kind == "stage":
                    sources.append((1, (ref.index, 0 if ref.item is None else ref.item)))
                else:
                    sources.append((2, ref.value))
                    if isinstance(ref.value, torch.Tensor):
                        others.append(ref.value)
            module = plan.module_for(st.index, 0)
            layout.append((module, sources, st.tuple_output,
                           module if st.recompute and plan.training else None,
                           plan.host_outputs[st.index]))
            others += [p for p in st.module.parameters() if id(p) not in wanted]
            others += list(st.module.buffers())
        return layout, others

    @staticmethod
    def fits(runner, schedule, memory) -> bool:
        """Whether this call can run as a chain: one thread, a chained schedule, gradients into
        ``p.grad``, no memory tracker, and on CUDA every stage on one GPU.
        """
        fused, plan = runner.fused, runner.plan
        devices = {plan.device_of(s) for s in range(plan.partition.num_stages)}
        return (fused is not None and fused.grads_in_params and schedule.chained
                and not by_action() and memory is None and plan.training
                and not (plan.record and any(d.type == "cuda" for d in devices)
                         and len(devices) > 1))

    def _mark(self, s: int):
        """A hook noting when the gradient reaching stage ``s``'s input is ready (s is done):
        on a GPU, an event recorded on autograd's stream at that point of the pass."""
        marks, clock = self.marks, self.clock

        def hook(_grad) -> None:
            marks[s] = clock()
        return hook

    def run(self, actions) -> None:
        """Run a chained lane's actions (see :meth:`fits`), noting what :func:`chain_events`
        needs."""
        runner, plan = self.runner, self.runner.plan
        n, stages, record, marks = self.n, self.stages, self.record, self.marks
        progress = runner.progress
        runner.running[0] = (actions, progress[0], 0)
        micro_inputs, results, keep_rows = runner.micro_inputs, runner.results, runner.keep_rows
        micro_batches = runner.micro_batches
        loss_of, loss_stage = plan.loss_of, plan.loss_stage
        scaling, params, ipus = self.seed_value, self.params, plan.stage_ipus
        seed = None  # one seed tensor for every micro-batch (autograd only reads it)
        named = params if self.named_inputs else None
        backward, clock = torch.autograd.backward, self.clock
        outs_of: list = [None] * n
        records, every = self.records, 2 * n * self.SAMPLE
        # the hooked ones: the second of every SAMPLE (the first follows the step: colder)
        offset = 2 * n if len(actions) > 2 * n else 0
        for first in range(0, len(actions), 2 * n):
            a = actions[first]
            k = a.iteration * micro_batches + a.micro_batch  # its row: one replica
            inputs = micro_inputs[k]
            hooked = record and first % every == offset
            if record:
                times = [clock()]
            for s in range(n):
                call, sources, tuple_output, recompute, host = stages[s]
                try:
                    args = []
                    hook = hooked and s
                    for where, what in sources:
                        if where == 1:
                            v = outs_of[what[0]][what[1]]
                            if hook and isinstance(v, torch.Tensor) and v.requires_grad:
                                hook = False  # the first one
                                v.register_hook(self._mark(s))
                        elif where == 0:
                            v = inputs[what]
                        elif where == 3:
                            v = inputs[what[0]].to(what[1])
                        else:
                            v = what
                        args.append(v)
                    out = call(*args) if recompute is None else \
                        checkpoint(recompute, *args, use_reentrant=False)
                except BaseException as exc:
                    _note(exc, actions[first + s], ipus, 0)
                    raise
                outs = outs_of[s] = out if tuple_output else (out,)
                if host and (keep_rows is None or k in keep_rows):
                    row = results[k]
                    for j, item in host:
                        v = outs[item]
                        row[j] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
                progress[0] += 1
                if record:
                    times.append(clock())
            # the micro-batch's backward: every stage's, in one pass
            try:
                loss = loss_of(outs_of[loss_stage])
                if loss is not None and params:
                    if scaling == 1.0 and loss.dim() == 0:
                        backward(loss, inputs=named)
                    else:
                        if seed is None or seed.shape != loss.shape or \
                                seed.dtype != loss.dtype or seed.device != loss.device:
                            seed = torch.full_like(loss, scaling)
                        backward(loss, seed, inputs=named)
            except BaseException as exc:
                _note(exc, actions[first + n], ipus, 0)
                raise
            outs_of = [None] * n  # the graph goes now, as the loop's would
            progress[0] += n
            if record:
                records.append((a, times, clock(), marks[1:] if hooked else None))
                if hooked:
                    marks[1:] = [None] * (n - 1)

    def spans(self):
        """What :func:`chain_events` turns into the call's events (nothing else of the call)."""
        return self.records, self.runner.plan.stage_ipus, self.seconds


def chain_events(records: list, ipus: List[int], t0: float, call_index: int,
                 seconds=None) -> List[Event]:
    """A :class:`Chain`'s micro-batches as events: forwards between consecutive clock readings,
    backwards split per stage as the hooked micro-batches measured. ``seconds`` turns a reading
    into a time.
    """
    n, events = len(ipus), []
    if seconds is not None:
        def at(e):
            return None if e is None else seconds(e)
        records = [(a, [at(t) for t in times], at(end), None if marks is None else
                    [at(m) for m in marks]) for a, times, end, marks in records]
    measured, sums = {}, [0.0] * n
    for i, (_, times, end, marks) in enumerate(records):
        if marks is None:
            continue
        start, ends = times[n], []
        began = start
        for s in reversed(range(n)):  # stage s: from its successor's end to its own
            done = marks[s - 1] if s else end
            began = end if done is None else max(began, done)
            ends.append(began)
        ends.reverse()
        measured[i] = ends
        total = end - start
        if total > 0:
            for s in range(n):
                sums[s] += (ends[s] - (ends[s + 1] if s < n - 1 else start)) / total
    weight = sum(sums)
    shares = [x / weight for x in sums] if weight > 0 else [1.0 / n] * n
    for i, (a, times, end, _) in enumerate(records):
        mb, it = a.micro_batch, a.iteration
        for s in range(n):
            events.append(Event(s, "forward", mb, times[s] - t0, times[s + 1] - t0, ipus[s],
                                0, it, call_index))
        start = times[n]
        ends = measured.get(i)
        if ends is None:
            ends, began = [end] * n, start
            for s in range(n - 1, 0, -1):
                began += shares[s] * (end - start)
                ends[s] = began
        began = start
        for s in reversed(range(n)):
            events.append(Event(s, "backward", mb, began - t0, ends[s] - t0, ipus[s], 0, it,
                                call_index))
            began = ends[s]
    return events


def _note(exc: BaseException, a: Action, ipus, replica: int) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(action_note(a, ipus[a.stage], replica))
