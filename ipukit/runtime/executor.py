"""Run a schedule on per-IPU workers and measure what each one did.

One worker (:mod:`ipukit.runtime.workers`) runs each lane of the
:class:`~ipukit.schedules.Schedule` for each replica, doing each action's work
(:mod:`ipukit.runtime.actions`), so stages really overlap; after each iteration's flush the
calling thread steps the optimiser once (:mod:`ipukit.runtime.update`), as PopART's weight
update did. A call with one worker runs on the calling thread. A call that fails or is
interrupted stops and joins every worker and restores the weights, buffers and optimiser
state from before the call.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, List, Optional

import torch

from . import fused, memory_track, update
from .actions import ActionRunner
from ..core.ops import running_on_ipu
from ..compile.program import Program
from ..schedules.ir import Schedule
from ..timeline.events import Event, Timeline
from .abort import abort_call
from . import watchdog as stall
from ..core.errors import StallError
from .contract import step_events
from .workers import Aborted, Exchange, InterruptGuard, Pool

__all__ = ["Aborted", "CallRunner", "Exchange", "StateSnapshot", "default_threads",
           "worker_cores"]

StateSnapshot = update.StateSnapshot


def default_threads(workers: int) -> int:
    """Intra-op threads per worker so that concurrent workers fill, not oversubscribe, the cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))


def worker_cores(workers: int) -> Optional[List[int]]:
    """The core each of ``workers`` worker threads is pinned to, or None: not pinned.

    Only with more workers than usable cores (Linux): worker ``i`` runs on core ``i`` mod the
    cores, so neighbouring lanes sit on different cores. ``IPUKIT_PIN_WORKERS=0`` turns it off;
    the calling thread is never pinned.
    """
    if not hasattr(os, "sched_setaffinity") or os.environ.get("IPUKIT_PIN_WORKERS") == "0":
        return None
    cores = sorted(os.sched_getaffinity(0))
    return None if workers <= len(cores) else [cores[i % len(cores)] for i in range(workers)]


def pin_this_thread(core: Optional[int]) -> None:
    """Run the calling thread on ``core`` only (None: leave it as it is)."""
    if core is None:
        return
    try:
        os.sched_setaffinity(0, {core})   # pid 0: this thread alone, on Linux
    except OSError:   # the core left this process's set meanwhile: stay free
        pass


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
                 call_index: int = 0, anchors=None, keep_rows=None,
                 stall_timeout: Optional[float] = None) -> None:
        self.plan, self.schedule, self.replicas, self.optimizer = plan, schedule, replicas, optimizer
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
                                    and not schedule.split_backward
                                    and not fused.by_action())
        self.events: List[List[Event]] = []
        self.steps_done = 0
        self.stall_timeout = stall_timeout  # seconds without a completed action (None: off)
        self.actions.progress = [0] * self.workers
        self.actions.running = [((), 0, 0)] * self.workers
        self.guard = InterruptGuard()
        # measured memory per virtual IPU (opt-in: memory_track.track_memory())
        self.memory = (memory_track.CallMemory(plan, schedule, replicas, optimizer, self.t0,
                                               micro_inputs) if memory_track.tracking(plan) else None)
        self.memory_tracks: list = []
        self.chain: Optional[fused.Chain] = None  # a sharded call's micro-batches (_run_inline)
        #: intra-op threads of each worker thread (a call on one thread keeps the caller's,
        #: unless cpuThreadsPerIpu says otherwise: then its host work runs at that count too)
        self.threads_each = (plan.threads_per_worker or default_threads(self.workers)
                             if self.workers > 1 else plan.threads_per_worker)

    @contextlib.contextmanager
    def host_threads(self):
        """The calling thread's host work runs at a worker's intra-op thread count (its OpenMP
        regions do not compete with the workers), restored after."""
        if self.threads_each is None:
            yield
            return
        callers = torch.get_num_threads()
        if callers != self.threads_each:
            torch.set_num_threads(self.threads_each)
        try:
            yield
        finally:
            if callers != self.threads_each:
                torch.set_num_threads(callers)

    def step(self, iteration: int) -> None:
        """Combine accumulated gradients (Mean or Sum) and step the optimiser once."""
        plan = self.plan
        t_start = time.perf_counter()
        one_pass = self.actions.fused
        in_params = one_pass is not None and one_pass.grads_in_params  # summed in p.grad already
        grads = None if in_params else update.reduce_gradients(self.accumulators, plan.trainable,
                                                               self.replicas)
        scale = (self.chain.step_scale if self.chain is not None else  # scaled in its seed
                 update.gradient_scale(plan.reduction, self.schedule.micro_batches * self.replicas,
                                       self.loss_scaling))
        with self.guard.deferred():  # Ctrl-C waits until the weights are consistent again
            if in_params:
                t_opt, t_end, transfers = update.step_in_place(
                    self.optimizer, one_pass.unique_params, scale, plan.offload_optimizer)
            else:
                t_opt, t_end, transfers = update.step(self.optimizer, grads, scale,
                                                      plan.offload_optimizer)
            if self.anchors is not None:
                self.anchors.step_done(iteration)
            self.steps_done += 1
            if self.memory is not None:
                self.memory.after_step()
        if plan.record:
            self._record_step(iteration, t_start, t_opt, t_end, transfers)

    def _record_step(self, iteration, t_start, t_opt, t_end, transfers) -> None:
        """The step runs once, on the host; the timeline draws it on every virtual IPU it updates."""
        stages = [(st.index, st.ipu) for st in self.plan.partition.stages]
        self.events.append(step_events(stages, range(self.replicas), iteration, self.call_index,
                                       t_start, t_opt, t_end, transfers, self.t0))

    def run(self, snapshot: Optional[update.StateSnapshot] = None) -> None:
        """Execute the whole call; on any failure stop and join every worker, restore the state, and
        raise the first error.
        """
        with self.guard, running_on_ipu(), self.host_threads():
            try:
                if self.workers == 1:
                    self._run_inline()
                else:
                    self._run_threads()
                if self.memory is not None:
                    self.memory_tracks = self.memory.finish()
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
        # a sharded call runs each micro-batch as a plain loop would (see fused.Chain)
        chain = self.chain = (fused.Chain(self.actions) if fused.Chain.fits(
            self.actions, self.schedule, self.memory) else None)
        try:
            with self._grad_mode(), self._memory(0, self.schedule.lane_ipus):
                for it in range(self._iterations()):
                    for lane in self.schedule.iteration_lanes(it):
                        if chain is not None:
                            chain.run(lane)
                        else:
                            run(lane, 0, stash, events, self.t0, self.call_index)
                    if self.plan.training:
                        self.step(it)
        finally:
            if threads:
                torch.set_num_threads(previous)

    def _run_threads(self) -> None:
        """One thread per (replica, lane); the calling thread steps between iterations and waits with
        short timeouts, so Ctrl-C is seen promptly.
        """
        schedule, training = self.schedule, self.plan.training
        iterations = self._iterations()
        go = [threading.Event() for _ in range(iterations)]
        finished = threading.Semaphore(0)
        threads_each = self.threads_each
        exchange = self.exchange
        lanes = len(schedule.lanes)
        per_worker: List[List[Event]] = [[] for _ in range(self.workers)]
        self.events.extend(per_worker)
        pins = worker_cores(self.workers)

        def work(index: int) -> None:
            replica, lane = divmod(index, lanes)
            torch.set_num_threads(threads_each)
            pin_this_thread(pins[index] if pins else None)
            stash: dict = {}
            with running_on_ipu(), self._grad_mode(), self._memory(replica,
                                                                   schedule.lane_ipus[lane:lane + 1]):
                for it in range(iterations):
                    go[it].wait()
                    if exchange.aborted:
                        return
                    actions = (schedule.iteration_lanes(it)[lane] if training
                               else schedule.lanes[lane])
                    self.actions.run(actions, replica, stash, per_worker[index], self.t0,
                                     self.call_index, index)
                    finished.release()

        names = [f"ipukit-ipu{ipu if ipu is not None else 'all'}-replica{r}"
                 for r in range(self.replicas) for ipu in schedule.lane_ipus]
        pool = Pool(names, work, on_error=exchange.abort).start()
        failure: Optional[BaseException] = None
        watch = (stall.Watchdog(self.stall_timeout, self.actions.progress)
                 if self.stall_timeout else None)
        try:  # the host's work in between (the reduction, the step): see host_threads
            for it in range(iterations):
                go[it].set()
                if watch is not None:
                    watch.restart()  # the host's step in between is no stall
                done = 0
                while done < self.workers and not exchange.aborted:
                    if finished.acquire(timeout=0.05):
                        done += 1
                    elif watch is not None and watch.stalled():
                        raise self._stalled(pool, it)
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

            # every worker has ended when this returns, even after a second Ctrl-C; after a
            # stall, a worker inside a user's operation cannot be stopped: wait a little only
            stalled = isinstance(failure, StallError)
            alive = abort_call(stop, pool.join, None, self.guard,
                               deadline=min(2.0, self.stall_timeout) if stalled else None,
                               absorb=failure is not None)
            if stalled and alive:
                failure.args = (failure.args[0] + stall.stuck_note(alive, failure.lanes),)
                failure.stuck = alive
        if pool.error is not None:
            raise pool.error

    def _stalled(self, pool: Pool, iteration: int) -> StallError:
        """The error of a call whose workers stopped completing actions: what each waits for."""
        schedule = self.schedule
        lanes_n = len(schedule.lanes)
        found = stall.frames()
        lanes = []
        for index, thread in enumerate(pool.threads):
            replica, lane = divmod(index, lanes_n)
            actions, before, _ = self.actions.running[index]
            done = self.actions.progress[index] - before
            ipu = schedule.lane_ipus[lane] if schedule.lane_ipus else lane
            label = (f"virtual IPU {ipu}" if ipu is not None else "the one lane") + \
                (f", replica {replica}" if self.replicas > 1 else "")
            frame = found.get(thread.ident)
            key = stall.waiting_key(frame) if frame is not None else None
            waits = waits_on = inside = None
            if key is not None:
                waits, waits_on = self._describe_wait(key)
            elif frame is not None and thread.is_alive():
                inside = stall.operation(frame) or f"the module of stage {actions[done].stage}" \
                    if done < len(actions) else None
            finished = not thread.is_alive() or (done >= len(actions) and key is None)
            lanes.append(stall.Lane(thread.name, label, actions, done, waits, waits_on, inside,
                                    finished))
        ipu_lane = {ipu: k for k, ipu in enumerate(schedule.lane_ipus)}

        def find(stage: int, replica: int):
            k = ipu_lane.get(schedule.stage_ipus[stage], 0)
            index = replica * lanes_n + k
            return lanes[index] if index < len(lanes) else None

        where = "virtual IPU" + (" or replica" if self.replicas > 1 else "")
        text = stall.message(self.stall_timeout, where, lanes, stall.cause_of(lanes, find))
        error = StallError(text)
        error.lanes, error.iteration = lanes, iteration
        return error

    def _describe_wait(self, key: tuple):
        """What a mailbox key is: words, and the (stage, replica) that will send it."""
        if key[0] == "A":
            _, stage, pos, _, micro, replica = key
            source = self.plan.partition.stages[stage].args[pos].index
            return (f"{source}F{micro}'s output from stage {source}", (source, replica))
        _, stage, consumer, _, _, micro, replica = key
        return (f"the gradient of micro-batch {micro} from stage {consumer} "
                f"({consumer}{'I' if self.schedule.split_backward else 'B'}{micro})",
                (consumer, replica))

    def _memory(self, replica: int, lane_ipus):
        """This thread's memory account: its lane's virtual IPU (one IPU for several lanes)."""
        if self.memory is None:
            return contextlib.nullcontext()
        return self.memory.thread(replica, lane_ipus[0] if len(lane_ipus) == 1 else None)

    def timeline_source(self, samples: int) -> Callable[[], Timeline]:
        """A function building the call's measured :class:`Timeline` (when it is first read:
        the spans are kept as measured, and nothing else of the call is held)."""
        lanes, clock, t0, call = self.events, self.actions.clock, self.t0, self.call_index
        spans = self.chain.spans() if self.chain is not None else None
        meta = dict(self.schedule.describe())
        meta.update({"schedule": self.schedule.kind, "replicas": self.replicas,
                     "samples": samples, "training": self.plan.training, "call": call})
        memory = list(self.memory_tracks)

        def build() -> Timeline:
            clock.resolve(t0)
            every = lanes + ([fused.chain_events(spans[0], spans[1], t0, call, seconds=spans[2])]
                             if spans else [])
            events = sorted((e for lane in every for e in lane), key=lambda e: (e.start, e.ipu))
            return Timeline(events, modeled=False, meta=meta, memory=memory)
        return build

    def timeline(self, samples: int) -> Timeline:
        return self.timeline_source(samples)()
