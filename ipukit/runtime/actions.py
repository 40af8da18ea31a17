"""The work of one action: a stage's forward or backward of one micro-batch.

Forwards take their inputs from the model's inputs or earlier stages' mailboxes and publish
their outputs; backwards take the gradients sent back, run ``torch.autograd.grad`` over this
stage, add the parameter gradients to the stage's accumulator and send the input gradients
on. Each returns the span it measured, from "inputs received" to "outputs computed".
"""
from __future__ import annotations

import time
from typing import Dict, List, Sequence, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from .contract import action_note
from .gpu_clock import GpuClock
from .fused import FusedBackward
from ..schedules.ir import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from .split_backward import backward_input, backward_weight
from ..timeline.events import Event, KIND_NAMES
from .update import LOW_PRECISION
from .workers import Aborted


class ActionRunner:
    """Runs actions of one call; shared by every worker of the call."""

    def __init__(self, plan, micro_batches: int, micro_inputs: List[list], replicas: int,
                 exchange, results: List[list], accumulators: dict, loss_scaling: float,
                 float32_accumulation: bool, anchors=None, keep_rows=None,
                 fused: bool = False) -> None:
        self.plan = plan
        self.micro_batches = micro_batches
        self.micro_inputs = micro_inputs
        self.replicas = replicas
        self.exchange = exchange
        self.results = results
        self.accumulators = accumulators
        self.loss_scaling = loss_scaling
        self.float32_accumulation = float32_accumulation
        self.anchors = anchors
        self.keep_rows = keep_rows  # micro-batch rows whose outputs the output mode returns
        # One thread runs every stage of a micro-batch in turn: one backward pass for all
        # (see ipukit.fused); schedules with split backwards keep their stages apart.
        self.fused = FusedBackward(self) if fused and plan.training else None
        self.clock = GpuClock()
        #: actions completed per worker slot (the watchdog's only cost on the hot path), and
        #: per slot the actions it runs now with the count completed before them
        self.progress: List[int] = [0]
        self.running: List[Tuple[Sequence[Action], int, int]] = [((), 0, 0)]

    def index(self, a: Action, replica: int) -> int:
        """The micro-batch's row in the call's combined batch."""
        return (a.iteration * self.micro_batches + a.micro_batch) * self.replicas + replica

    def forward(self, a: Action, replica: int, stash: dict) -> Tuple[float, float]:
        plan = self.plan
        stage = plan.partition.stages[a.stage]
        device = plan.device_of(a.stage)
        k = self.index(a, replica)
        inputs = self.micro_inputs[k]
        hooked = False
        args = []
        for pos, ref in enumerate(stage.args):
            if ref.kind == "input":
                v = inputs[plan.tensor_inputs[ref.index]]
                if v.device != device:
                    v = v.to(device)
            elif ref.kind == "stage":
                v = self.exchange.take(("A", a.stage, pos, a.iteration, a.micro_batch, replica))
                if self.fused is not None:
                    if isinstance(v, torch.Tensor) and v.requires_grad and not hooked:
                        hooked = True
                        v.register_hook(self.fused.timer(stash, a))
                elif isinstance(v, torch.Tensor):
                    needs_grad = plan.training and v.requires_grad
                    v = v.detach()
                    if v.device != device:
                        v = v.to(device)
                    if needs_grad:
                        v.requires_grad_()
            else:
                v = ref.value
            args.append(v)
        on_gpu = device.type == "cuda" and plan.record
        ready = self.clock.mark(device) if on_gpu else time.perf_counter()
        module = plan.module_for(a.stage, replica)
        if stage.recompute and plan.training:  # keep the inputs, rerun the forward in B/I
            out = checkpoint(module, *args, use_reentrant=False)
        else:
            out = module(*args)
        outs = out if stage.tuple_output else (out,)
        if self.keep_rows is None or k in self.keep_rows:
            row = self.results[k]
            for j, item in plan.host_outputs[a.stage]:
                v = outs[item]
                row[j] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
        if plan.training:
            stash[(a.stage, a.iteration, a.micro_batch)] = (args, outs)
        # before publishing: a consumer never starts before this
        end = self.clock.mark(device) if on_gpu else time.perf_counter()
        for consumer, pos, item in plan.consumers[a.stage]:
            self.exchange.put(("A", consumer, pos, a.iteration, a.micro_batch, replica), outs[item])
        return ready, end


    def _seeds(self, a: Action, replica: int, outs) -> Tuple[list, list]:
        """The stage's outputs that later stages sent gradients for (and the loss), with them."""
        plan = self.plan
        s = a.stage
        incoming: Dict[int, torch.Tensor] = {}
        for consumer, pos, item in plan.consumers[s]:
            src = outs[item]
            if isinstance(src, torch.Tensor) and src.requires_grad:
                g = self.exchange.take(("G", s, consumer, pos, a.iteration, a.micro_batch, replica))
                if g is not None:
                    if g.device != src.device:  # the consumer ran on another device
                        g = g.to(src.device)
                    incoming[item] = incoming[item] + g if item in incoming else g
        seeds = [outs[i] for i in incoming]
        grads = [incoming[i] for i in incoming]
        if s == plan.loss_stage:
            loss = self.plan.loss_of(outs)
            if loss is not None:
                seeds.append(loss)
                # loss scaling (PopTorch's optimiser argument): scaled here, unscaled at the step
                grads.append(torch.full_like(loss, self.loss_scaling))
        return seeds, grads

    def _send_input_grads(self, a: Action, replica: int, diff_inputs, grads) -> None:
        stage_args = self.plan.partition.stages[a.stage].args
        for (pos, _), g in zip(diff_inputs, grads):
            ref = stage_args[pos]
            if ref.kind == "stage":
                self.exchange.put(("G", ref.index, a.stage, pos, a.iteration, a.micro_batch,
                                   replica), g)

    def _clock(self, stage: int):
        device = self.plan.device_of(stage)
        if device.type == "cuda" and self.plan.record:
            return lambda: self.clock.mark(device)
        return time.perf_counter

    def backward(self, a: Action, replica: int, stash: dict) -> Tuple[float, float]:
        """A full backward (``B``): input and parameter gradients in one autograd pass."""
        if self.fused is not None:
            return self.fused(a, replica, stash)
        args, outs = stash.pop((a.stage, a.iteration, a.micro_batch))
        seeds, grads = self._seeds(a, replica, outs)
        now = self._clock(a.stage)
        ready = now()
        diff_inputs = [(pos, v) for pos, v in enumerate(args)
                       if isinstance(v, torch.Tensor) and v.requires_grad]
        params = self.plan.trainable[a.stage]
        targets = [v for _, v in diff_inputs] + params
        if seeds and targets:
            result = torch.autograd.grad(seeds, targets, grads, allow_unused=True)
        else:
            result = [None] * len(targets)
        self.accumulate(a, replica, params, result[len(diff_inputs):])
        end = now()
        self._send_input_grads(a, replica, diff_inputs, result)
        return ready, end

    def accumulate(self, a: Action, replica: int, params, grads: Sequence) -> None:
        acc = self.accumulators[(replica, a.stage)]
        for i, g in enumerate(grads):
            if self.anchors is not None:  # before accumulation changes g in place
                self.anchors.gradient(self.index(a, replica), a.stage, i, params[i], g)
            if g is None:
                continue
            if self.float32_accumulation and g.dtype in LOW_PRECISION:
                g = g.float()  # accumulate half-precision gradients in float32
            if acc[i] is None:
                acc[i] = g
            else:
                acc[i].add_(g)

    def run(self, actions: Sequence[Action], replica: int, stash: dict, events: List[Event],
            t0: float, call_index: int, slot: int = 0) -> None:
        """Run ``actions`` in order (steps are the host's, skipped here); record their spans.

        ``slot``: the worker's counter in :attr:`progress` (one per worker)."""
        progress = self.progress
        self.running[slot] = (actions, progress[slot], replica)
        record = self.plan.record
        ipus = self.plan.stage_ipus
        exchange = self.exchange
        forward, backward = self.forward, self.backward
        split = {INPUT_GRAD: self.input_grad, WEIGHT_GRAD: self.weight_grad}
        for a in actions:
            if exchange.aborted:
                raise Aborted()
            kind = a.kind
            try:
                if kind == FORWARD:
                    start, end = forward(a, replica, stash)
                elif kind == BACKWARD:
                    start, end = backward(a, replica, stash)
                elif kind in split:
                    start, end = split[kind](a, replica, stash)
                else:
                    continue
            except (Aborted, KeyboardInterrupt):
                raise
            except BaseException as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(action_note(a, ipus[a.stage], replica))
                raise
            progress[slot] += 1
            if record:
                if type(start) is float:
                    events.append(Event(a.stage, KIND_NAMES[kind], a.micro_batch, start - t0,
                                        end - t0, ipus[a.stage], replica, a.iteration, call_index))
                else:  # CUDA events: resolved into times once the call has finished
                    events.append(Event(a.stage, KIND_NAMES[kind], a.micro_batch, 0.0, 0.0,
                                        ipus[a.stage], replica, a.iteration, call_index))
                    self.clock.later(events, len(events) - 1, self.plan.device_of(a.stage),
                                     start, end)

    # -- the split backward's halves: I now, W later -------------------------------------

    def input_grad(self, a, replica: int, stash: dict) -> Tuple[float, float]:
        """The input-gradient half (``I``): what the previous stage waits for, sent at once."""
        key = (a.stage, a.iteration, a.micro_batch)
        args, outs = stash.pop(key)
        stage = self.plan.partition.stages[a.stage]
        if stage.recompute:  # rebuild the stage's graph once, here: I and W share it
            out = self.plan.module_for(a.stage, replica)(*args)
            outs = out if stage.tuple_output else (out,)
        seeds, grads = self._seeds(a, replica, outs)
        now = self._clock(a.stage)
        ready = now()
        diff_inputs = [(pos, v) for pos, v in enumerate(args)
                       if isinstance(v, torch.Tensor) and v.requires_grad]
        dinputs, pending = backward_input(seeds, grads, [v for _, v in diff_inputs],
                                          self.plan.trainable[a.stage])
        stash[("W",) + key] = pending
        end = now()
        self._send_input_grads(a, replica, diff_inputs, dinputs)
        return ready, end

    def weight_grad(self, a, replica: int, stash: dict) -> Tuple[float, float]:
        """The weight-gradient half (``W``): from what ``I`` kept, into the accumulators."""
        pending = stash.pop(("W", a.stage, a.iteration, a.micro_batch))
        now = self._clock(a.stage)
        ready = now()
        params = self.plan.trainable[a.stage]
        self.accumulate(a, replica, params, backward_weight(pending, params))
        return ready, now()


