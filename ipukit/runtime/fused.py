"""The single-thread backward: one autograd pass for every stage of a micro-batch.

When one thread runs every stage of a micro-batch in turn (a sharded model, or
one worker for the whole call), the stages' autograd graphs stay connected and
one backward pass serves them all, as in a plain PyTorch loop. Gradient hooks
at the stage boundaries note when each stage's share began, so the timeline
still shows one backward span per stage.
"""
from __future__ import annotations

import time
from typing import Tuple

import torch

from ..schedules.ir import Action


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
