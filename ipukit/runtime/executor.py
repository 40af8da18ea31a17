"""Run a schedule on per-IPU workers and measure what each one did.

This module only orchestrates a call: one worker (:mod:`ipukit.workers`) runs
each lane of the :class:`~ipukit.schedule.Schedule` for each replica, doing
the work of each action (:mod:`ipukit.actions`), so stages really overlap in
time; at the end of an iteration (the pipeline flushed) the calling thread
steps the optimiser once (:mod:`ipukit.update`), as PopART's weight update did.
A call with one worker (a sharded or one-stage model, one replica) runs on the
calling thread with no hand-off at all.

A call that fails or is interrupted stops every worker, joins them, and
restores the weights, buffers and optimiser state from before the call —
Ctrl-C pressed again meanwhile waits until that is done.
"""
from __future__ import annotations

import os
import threading
import time
from typing import List, Optional

import torch

from . import update
from .actions import ActionRunner
from ..core.ops import running_on_ipu
from ..compile.program import Program
from ..schedules.ir import Schedule
from ..timeline.events import Event, Timeline
from .abort import abort_call
from .contract import step_events
from .workers import Aborted, Exchange, InterruptGuard, Pool

__all__ = ["Aborted", "CallRunner", "Exchange", "StateSnapshot", "default_threads"]

StateSnapshot = update.StateSnapshot


def default_threads(workers: int) -> int:
    """Intra-op threads per worker so that concurrent workers fill, not oversubscribe, the cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))


class _LocalExchange(dict):
    """Mailboxes for a call on one thread: a plain dict, no locks or events."""

    aborted = False

    def put(self, key: tuple, value) -> None:
        self[key] = value

    def take(self, key: tuple):
        return self.pop(key)

    def abort(self) -> None:
        pass


class CallRunner:
    """Executes one model call: ``micro_inputs`` through ``schedule``."""

    def __init__(self, plan: Program, schedule: Schedule, micro_inputs: List[list],
                 replicas: int, optimizer=None, clock_origin: Optional[float] = None,
                 call_index: int = 0, anchors=None, keep_rows=None) -> None:
        self.plan = plan
        self.schedule = schedule
        self.replicas = replicas
        self.optimizer = optimizer
        self.anchors = anchors  # an anchors.AnchorRecorder when tensors are anchored
        self.t0 = time.perf_counter() if clock_origin is None else clock_origin
        self.call_index = call_index
        self.workers = len(schedule.lanes) * replicas
        n_out = len(plan.partition.outputs)
        self.results: List[list] = [[None] * n_out for _ in micro_inputs]
        self.accumulators = {(r, s): [None] * len(plan.trainable[s])
                             for r in range(replicas) for s in range(plan.partition.num_stages)}
        self.exchange = Exchange() if self.workers > 1 else _LocalExchange()
        self.loss_scaling, float32_accumulation = update.precision(optimizer)
        self.actions = ActionRunner(plan, schedule.micro_batches, micro_inputs, replicas,
                                    self.exchange, self.results, self.accumulators,
                                    self.loss_scaling, float32_accumulation, anchors, keep_rows,
                                    fused=(schedule.sequential or self.workers == 1)
                                    and not schedule.split_backward)
        self.events: List[List[Event]] = []
        self.steps_done = 0
        self.guard = InterruptGuard()

    def step(self, iteration: int) -> None:
        """Combine accumulated gradients (Mean or Sum) and step the optimiser once."""
        plan = self.plan
        t_start = time.perf_counter()
        if self.actions.fused is not None:
            self.actions.fused.collect(self.accumulators)
        grads = update.reduce_gradients(self.accumulators, plan.trainable, self.replicas)
        scale = update.gradient_scale(plan.reduction, self.schedule.micro_batches * self.replicas,
                                      self.loss_scaling)
        with self.guard.deferred():  # Ctrl-C waits until the weights are consistent again
            t_opt, t_end, transfers = update.step(self.optimizer, grads, scale,
                                                  plan.offload_optimizer)
            if self.anchors is not None:
                self.anchors.step_done(iteration)
            self.steps_done += 1
        if plan.record:
            self._record_step(iteration, t_start, t_opt, t_end, transfers)

    def _record_step(self, iteration, t_start, t_opt, t_end, transfers) -> None:
        """The step runs once, on the host; the timeline draws it on every virtual IPU it updates."""
        stages = [(st.index, st.ipu) for st in self.plan.partition.stages]
        self.events.append(step_events(stages, range(self.replicas), iteration, self.call_index,
                                       t_start, t_opt, t_end, transfers, self.t0))

    def run(self, snapshot: Optional[update.StateSnapshot] = None) -> None:
        """Execute the whole call; on any failure, stop and join every worker, then restore.

        Raises the first error (a worker's, the step's, or Ctrl-C) once the
        state is as it was before the call.
        """
        with self.guard, running_on_ipu():
            try:
                if self.workers == 1:
                    self._run_inline()
                else:
                    self._run_threads()
            except BaseException:
                # every worker has ended here (see _run_threads): what is left is the state
                if snapshot is not None:
                    abort_call(lambda: None, lambda _: [], snapshot.restore, self.guard)
                raise

    def _grad_mode(self):
        return torch.enable_grad() if self.plan.training else torch.no_grad()

    def _iterations(self) -> int:
        return self.schedule.iterations if self.plan.training else 1

    def _run_inline(self) -> None:
        """A single worker runs on the calling thread (no hand-offs at all)."""
        if self.actions.fused is not None:  # its backward may add into p.grad: start clean
            self.actions.fused.start()
        events: List[Event] = []
        self.events.append(events)
        threads = self.plan.threads_per_worker
        previous = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        run, stash = self.actions.run, {}
        try:
            with self._grad_mode():
                for it in range(self._iterations()):
                    for lane in self.schedule.iteration_lanes(it):
                        run(lane, 0, stash, events, self.t0, self.call_index)
                    if self.plan.training:
                        self.step(it)
        finally:
            if threads:
                torch.set_num_threads(previous)

    def _run_threads(self) -> None:
        """One thread per (replica, lane); the calling thread steps between iterations.

        The calling thread only ever waits with short timeouts, so Ctrl-C is
        seen promptly; the pool then stops the workers between actions and
        joins every one of them before anything else happens.
        """
        schedule, training = self.schedule, self.plan.training
        iterations = self._iterations()
        go = [threading.Event() for _ in range(iterations)]
        finished = threading.Semaphore(0)
        threads_each = self.plan.threads_per_worker or default_threads(self.workers)
        exchange = self.exchange
        lanes = len(schedule.lanes)
        per_worker: List[List[Event]] = [[] for _ in range(self.workers)]
        self.events.extend(per_worker)

        def work(index: int) -> None:
            replica, lane = divmod(index, lanes)
            torch.set_num_threads(threads_each)
            stash: dict = {}
            with running_on_ipu(), self._grad_mode():
                for it in range(iterations):
                    go[it].wait()
                    if exchange.aborted:
                        return
                    actions = (schedule.iteration_lanes(it)[lane] if training
                               else schedule.lanes[lane])
                    self.actions.run(actions, replica, stash, per_worker[index], self.t0,
                                     self.call_index)
                    finished.release()

        names = [f"ipukit-ipu{ipu if ipu is not None else 'all'}-replica{r}"
                 for r in range(self.replicas) for ipu in schedule.lane_ipus]
        pool = Pool(names, work, on_error=exchange.abort).start()
        failure: Optional[BaseException] = None
        try:
            for it in range(iterations):
                go[it].set()
                done = 0
                while done < self.workers and not exchange.aborted:
                    if finished.acquire(timeout=0.05):
                        done += 1
                if exchange.aborted:
                    break
                if training:
                    self.step(it)
        except BaseException as exc:  # KeyboardInterrupt, or a failed step
            failure = exc
        finally:
            def stop() -> None:
                if failure is not None:
                    pool.fail(failure)
                for event in go:   # workers waiting for a later iteration see the abort
                    event.set()

            # every worker has ended when this returns, even after a second Ctrl-C
            abort_call(stop, pool.join, None, self.guard, absorb=failure is not None)
        if pool.error is not None:
            raise pool.error

    def timeline(self, samples: int) -> Timeline:
        self.actions.clock.resolve(self.t0)
        events = sorted((e for lane in self.events for e in lane), key=lambda e: (e.start, e.ipu))
        meta = dict(self.schedule.describe())
        meta.update({"schedule": self.schedule.kind, "replicas": self.replicas,
                     "samples": samples, "training": self.plan.training,
                     "call": self.call_index})
        return Timeline(events, modeled=False, meta=meta)
