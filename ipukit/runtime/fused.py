"""The single-thread backward: one autograd pass for every stage of a micro-batch.

When one thread runs every stage of a micro-batch in turn (a sharded model, or
one worker for the whole call), the stages' autograd graphs stay connected and
one backward pass serves them all, as in a plain PyTorch loop. Gradient hooks
at the stage boundaries note when each stage's share began, so the timeline
still shows one backward span per stage.

A lane that runs each micro-batch whole before the next (``Schedule.chained``: a
sharded call) goes further with :class:`Chain`: the stages' modules run one after
another with their outputs passed straight on, and one ``backward()`` from the loss adds
into ``p.grad``, as a plain loop's ``loss.backward()`` does.
"""
from __future__ import annotations

import time
from typing import List, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from .._torch import direct_forward
from ..schedules.ir import Action
from ..timeline.events import Event
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
        runner = self.runner
        plan = runner.plan
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

    def collect(self, accumulators: dict) -> None:
        """Move gradients accumulated in ``p.grad`` to the call's accumulators."""
        if not self.grads_in_params:
            return
        for s, params in enumerate(self.runner.plan.trainable):
            acc = accumulators[(0, s)]
            for i, p in enumerate(params):
                if p.grad is not None:
                    acc[i], p.grad = p.grad, None


class Chain:
    """A chained lane (:attr:`~ipukit.schedules.ir.Schedule.chained`) run as a plain loop runs it.

    For each micro-batch: every stage's module in turn, each output handed straight to the
    stages that take it (no mailboxes, no stash), then one ``backward()`` from the loss
    (scaled by the loss scaling) that adds the micro-batch's gradients into ``p.grad``. So
    the weights after the call are those of the action-by-action path (the same
    operations, the same accumulation), and the work around each pass is what a plain loop
    pays: no hook is registered per micro-batch. ``backward`` goes without ``inputs=``
    (which costs autograd a walk of the graph every micro-batch) when the parameters are
    the only tensors in the graph that want a gradient; otherwise it names them.

    The timeline is measured as before: one clock reading between consecutive forwards,
    and each stage's share of the backward from its successor's end to its own. A stage's
    backward ends once its last parameter gradient is added (a hook on each of its
    parameters, registered once per call: autograd adds a gradient as soon as it is
    computed, before anything of earlier stages runs); a stage without parameters of its
    own (or sharing one with another stage) is timed by a gradient hook on its input.
    Counters: one progress increment per action, as the action-by-action path does.
    """

    def __init__(self, runner) -> None:
        self.runner = runner
        plan = runner.plan
        self.n = n = plan.partition.num_stages
        self.stages = []
        self.params = runner.fused.params
        self.named_inputs = not self._only_parameters_want_grad(plan, runner.micro_inputs)
        self.record = plan.record
        self.marks: List = [None] * n
        owners: dict = {}
        for s in range(n):
            for p in plan.trainable[s]:
                owners.setdefault(id(p), set()).add(s)
        #: per stage: time its backward by its parameters (True) or by a hook on its input
        self.by_params = [bool(plan.trainable[s]) and
                          all(len(owners[id(p)]) == 1 for p in plan.trainable[s])
                          for s in range(n)]
        self.handles: list = []
        first_row = runner.micro_inputs[0] if runner.micro_inputs else []
        #: per stage: (its forward, where each argument comes from, tuple output, the module
        #: when it recomputes, its outputs the host keeps, whether to hook its input)
        self.stages = []
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
            module = plan.module_for(st.index, 0)
            self.stages.append((direct_forward(module), sources, st.tuple_output,
                                module if st.recompute and plan.training else None,
                                plan.host_outputs[st.index],
                                self.record and st.index > 0 and not self.by_params[st.index]))

    @staticmethod
    def fits(runner, schedule, memory) -> bool:
        """Whether this call can run as a chain: one thread, a chained schedule, gradients
        into ``p.grad`` (:attr:`FusedBackward.grads_in_params`), no memory tracker (it
        measures the action-by-action path) and no CUDA clock to read."""
        fused, plan = runner.fused, runner.plan
        return (fused is not None and fused.grads_in_params and schedule.chained
                and memory is None and plan.training
                and not (plan.record and any(d.type == "cuda" for d in plan.devices.values())))

    @staticmethod
    def _only_parameters_want_grad(plan, micro_inputs) -> bool:
        """No tensor other than the stages' trainable parameters is a leaf wanting a gradient:
        no input, constant argument, buffer or parameter left out of ``plan.trainable``."""
        for row in micro_inputs:
            for v in row:
                if isinstance(v, torch.Tensor) and v.requires_grad:
                    return False
        wanted = {id(p) for params in plan.trainable for p in params}
        for st in plan.partition.stages:
            for ref in st.args:
                if isinstance(ref.value, torch.Tensor) and ref.value.requires_grad:
                    return False
            for p in st.module.parameters():
                if p.requires_grad and id(p) not in wanted:
                    return False
            for b in st.module.buffers():
                if b.requires_grad:
                    return False
        return True

    def __enter__(self) -> "Chain":
        if self.record:
            plan, marks, clock = self.runner.plan, self.marks, time.perf_counter
            for s in range(1, self.n):
                if self.by_params[s]:
                    def mark(_p, s=s) -> None:
                        marks[s] = clock()
                    self.handles += [p.register_post_accumulate_grad_hook(mark)
                                     for p in plan.trainable[s]]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _tensor_mark(self, s: int):
        marks, clock = self.marks, time.perf_counter

        def hook(_grad) -> None:
            marks[s] = clock()
        return hook

    def run(self, actions, events: List[Event], t0: float, call_index: int) -> None:
        """Run a chained lane's actions (see :meth:`fits`); record their spans in ``events``."""
        runner = self.runner
        plan = runner.plan
        n, stages, record, marks = self.n, self.stages, self.record, self.marks
        progress = runner.progress
        runner.running[0] = (actions, progress[0], 0)
        micro_inputs, results, keep_rows = runner.micro_inputs, runner.results, runner.keep_rows
        micro_batches = runner.micro_batches
        loss_of, loss_stage = plan.loss_of, plan.loss_stage
        scaling, params, ipus = runner.loss_scaling, self.params, plan.stage_ipus
        named = params if self.named_inputs else None
        backward, clock = torch.autograd.backward, time.perf_counter
        outs_of: list = [None] * n
        times = [0.0] * (n + 1)
        for first in range(0, len(actions), 2 * n):
            a = actions[first]
            k = a.iteration * micro_batches + a.micro_batch  # its row: one replica
            inputs = micro_inputs[k]
            if record:
                times[0] = clock()
            for s in range(n):
                call, sources, tuple_output, recompute, host, hook = stages[s]
                try:
                    args = []
                    for where, what in sources:
                        if where == 1:
                            v = outs_of[what[0]][what[1]]
                            if hook and isinstance(v, torch.Tensor) and v.requires_grad:
                                hook = False  # the first: when its gradient is ready, s is done
                                v.register_hook(self._tensor_mark(s))
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
                    times[s + 1] = clock()
            # the micro-batch's backward: every stage's, in one pass
            try:
                loss = loss_of(outs_of[loss_stage])
                if loss is not None and params:
                    if scaling == 1.0 and loss.dim() == 0:
                        backward(loss, inputs=named)
                    else:
                        backward(loss, torch.full_like(loss, scaling), inputs=named)
            except BaseException as exc:
                _note(exc, actions[first + n], ipus, 0)
                raise
            outs_of = [None] * n  # the graph goes now, as the loop's would
            progress[0] += n
            if record:
                self._record(events, a, times, clock(), t0, call_index)

    def _record(self, events: List[Event], a: Action, times: list, end: float, t0: float,
                call_index: int) -> None:
        """One micro-batch's spans: forwards between clock readings, the backward's shares
        between the stages' marks (each taken and cleared)."""
        n, marks, ipus = self.n, self.marks, self.runner.plan.stage_ipus
        mb, it = a.micro_batch, a.iteration
        for s in range(n):
            events.append(Event(s, "forward", mb, times[s] - t0, times[s + 1] - t0, ipus[s], 0,
                                it, call_index))
        began = times[n]
        for s in reversed(range(n)):
            done = marks[s] if s else end
            marks[s] = None
            done = end if done is None else max(began, done)
            events.append(Event(s, "backward", mb, began - t0, done - t0, ipus[s], 0, it,
                                call_index))
            began = done


def _note(exc: BaseException, a: Action, ipus, replica: int) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(action_note(a, ipus[a.stage], replica))
