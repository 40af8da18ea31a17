"""Run a schedule on per-IPU workers and measure what each one did.

One worker thread runs each lane of the :class:`~ipukit.schedule.Schedule`
for each replica: the worker of virtual IPU *i* executes, in order, the
forwards and backwards the schedule gives it. Workers hand activations
forward and gradients backward through an :class:`Exchange`, so stages really
overlap in time. Each backward computes ``torch.autograd.grad`` of its stage
only and adds the parameter gradients to the stage's own accumulator; at the
end of an iteration (the pipeline flushed) the host combines the accumulators
— Mean or Sum over micro-batches and replicas — and steps the optimiser once,
as PopART's weight update did.

A call that fails or is interrupted stops every worker, joins them, and
leaves the weights and optimiser state as they were before the call.
"""
from __future__ import annotations

import copy
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .enums import ReductionType
from .partition import Partition
from .schedule import BACKWARD, FORWARD, STEP, Action, Schedule
from .timeline import Event, KIND_NAMES, Timeline


class Aborted(Exception):
    """Raised inside workers when another worker failed or the call was interrupted."""


class Exchange:
    """Mailboxes between workers: activations forward, gradients backward.

    One slot per message key, each with its own event, so a message wakes
    only the worker waiting for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: Dict[tuple, list] = {}
        self._aborted = False

    def _slot(self, key: tuple) -> list:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = [None, threading.Event()]
                if self._aborted:
                    slot[1].set()
            return slot

    def put(self, key: tuple, value: Any) -> None:
        slot = self._slot(key)
        slot[0] = value
        slot[1].set()

    def take(self, key: tuple) -> Any:
        slot = self._slot(key)
        slot[1].wait()
        if self._aborted:
            raise Aborted()
        with self._lock:
            del self._slots[key]
        return slot[0]

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            for slot in self._slots.values():
                slot[1].set()

    @property
    def aborted(self) -> bool:
        return self._aborted


@dataclass
class Plan:
    """Everything about a compiled model that stays fixed from call to call."""

    partition: Partition
    training: bool
    devices: Dict[int, torch.device]           # virtual IPU -> torch device
    reduction: ReductionType = ReductionType.Mean
    threads_per_worker: Optional[int] = None
    offload_optimizer: bool = False
    record: bool = True
    # derived
    consumers: List[List[Tuple[int, int, int]]] = field(default_factory=list)
    host_outputs: List[List[Tuple[int, int]]] = field(default_factory=list)
    trainable: List[List[torch.nn.Parameter]] = field(default_factory=list)
    tensor_inputs: List[int] = field(default_factory=list)
    loss_stage: Optional[int] = None
    loss_item: int = 0
    # (stage, replica >= 1) -> that replica's copy of a stage module with buffers
    replica_modules: Dict[Tuple[int, int], torch.nn.Module] = field(default_factory=dict)

    def __post_init__(self) -> None:
        part = self.partition
        n = part.num_stages
        self.consumers = [[(c, pos, 0 if item is None else item)
                           for c, pos, item in part.consumers(s)] for s in range(n)]
        self.host_outputs = [[] for _ in range(n)]
        for j, ref in enumerate(part.outputs):
            if ref.kind == "stage":
                self.host_outputs[ref.index].append((j, 0 if ref.item is None else ref.item))
        self.trainable = [[p for p in st.parameters if p.requires_grad] for st in part.stages]
        if part.loss_output is not None and self.training:
            ref = part.outputs[part.loss_output]
            if ref.kind == "stage":
                self.loss_stage = ref.index
                self.loss_item = 0 if ref.item is None else ref.item

    def device_of(self, stage: int) -> torch.device:
        return self.devices.get(self.partition.stages[stage].ipu, torch.device("cpu"))

    def module_for(self, stage: int, replica: int) -> torch.nn.Module:
        """The module replica ``replica`` runs for ``stage`` (see :meth:`prepare_replicas`)."""
        mine = self.replica_modules.get((stage, replica))
        return self.partition.stages[stage].module if mine is None else mine

    def prepare_replicas(self, replicas: int) -> None:
        """Give replicas 1.. their own buffers, starting from the host's (replica 0's).

        Replicas share the weights, but each has its own buffers (BatchNorm
        statistics), as each IPU replica had: a replica's statistics see only
        its own micro-batches, and replicas never race on one tensor. Replica 0
        runs the user's modules, so the host keeps replica 0's statistics.
        Called before each call's workers start: copies are made once, then
        refreshed from the host, so they never go stale.
        """
        if replicas <= 1:
            return
        for index, stage in enumerate(self.partition.stages):
            original = stage.module
            if next(original.buffers(), None) is None:
                continue
            for replica in range(1, replicas):
                mine = self.replica_modules.get((index, replica))
                if mine is None:
                    shared = {id(p): p for p in original.parameters()}  # deepcopy keeps these
                    self.replica_modules[(index, replica)] = copy.deepcopy(original, shared)
                    continue
                with torch.no_grad():
                    for theirs, own in zip(original.buffers(), mine.buffers()):
                        own.copy_(theirs)
                for theirs, own in zip(original.modules(), mine.modules()):
                    own.training = theirs.training


LOW_PRECISION = (torch.float16, torch.bfloat16)


def _precision(optimizer) -> Tuple[float, bool]:
    """(loss scaling, accumulate half-precision gradients in float32) for ``optimizer``.

    PopTorch's optimisers take ``loss_scaling`` (default 1) and accumulate
    gradients in ``accum_type`` (default float32) whatever the weights' type;
    plain torch.optim optimisers get those defaults too.
    """
    args = getattr(optimizer, "ipu_arguments", None) or {}
    scaling = float(args.get("loss_scaling", 1.0))
    return scaling, args.get("accum_type", torch.float32) != torch.float16


@contextmanager
def _float32_update(params):
    """Step half-precision weights in float32, then round them back.

    The optimiser then creates and keeps its state (Adam's moments, momentum)
    in float32: in half precision, Adam's eps (1e-8) rounds to 0 and a zero
    gradient turns a weight into NaN.
    """
    low = [(p, p.dtype) for p in params if p.dtype in LOW_PRECISION]
    for p, _ in low:
        p.data = p.data.float()
    try:
        yield
    finally:
        for p, dtype in low:
            p.grad = None
            p.data = p.data.to(dtype)


class StateSnapshot:
    """Copies of weights, buffers and optimiser state, to undo a failed call."""

    def __init__(self, module: torch.nn.Module, optimizer, weights: bool) -> None:
        with torch.no_grad():
            self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
            self.params = ([(p, p.detach().clone()) for p in module.parameters()]
                           if weights else [])
        self.optimizer = optimizer
        self.opt_state = None
        if weights and optimizer is not None:
            self.opt_state = {p: {k: (v.detach().clone() if torch.is_tensor(v) else v)
                                  for k, v in st.items()}
                              for p, st in optimizer.state.items()}

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.buffers + self.params:
                live.copy_(saved)
        for group in (self.optimizer.param_groups if self.optimizer is not None else []):
            for p in group["params"]:
                p.grad = None
        if self.opt_state is not None:
            state = self.optimizer.state
            for p in list(state.keys()):
                if p not in self.opt_state:
                    del state[p]
            for p, saved in self.opt_state.items():
                live = state[p]
                for k, v in saved.items():
                    if torch.is_tensor(v) and torch.is_tensor(live.get(k)):
                        live[k].copy_(v)
                    else:
                        live[k] = v


@contextmanager
def _interrupts_wait_for_steps(runner: "CallRunner"):
    """While a call runs, Ctrl-C stops it at once — except inside an optimiser step,
    which it lets finish first, so weights and optimiser state are never half updated."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if runner._stepping:
            runner._interrupted = True
        else:
            raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # signals unavailable (embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _move_optimizer_state(optimizer, to_host: bool) -> List[Tuple[float, float]]:
    """Offloaded optimiser state: host memory between steps, the parameter's device during one."""
    spans = []
    for p, st in optimizer.state.items():
        target = torch.device("cpu") if to_host else p.device
        for k, v in st.items():
            if torch.is_tensor(v) and v.device != target and v.dim() > 0:
                t0 = time.perf_counter()
                st[k] = v.to(target, non_blocking=False)
                spans.append((t0, time.perf_counter()))
    return spans


def default_threads(workers: int) -> int:
    """Intra-op threads per worker so that concurrent workers fill, not oversubscribe, the cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))


class CallRunner:
    """Executes one model call: ``micro_inputs`` through ``schedule``."""

    def __init__(self, plan: Plan, schedule: Schedule, micro_inputs: List[list],
                 replicas: int, optimizer=None, clock_origin: Optional[float] = None,
                 call_index: int = 0, anchors=None) -> None:
        self.plan = plan
        self.anchors = anchors  # an anchors.AnchorRecorder when tensors are anchored
        self.loss_scaling, self.float32_accumulation = _precision(optimizer)
        self.schedule = schedule
        self.micro_inputs = micro_inputs
        self.replicas = replicas
        self.optimizer = optimizer
        self.exchange = Exchange()
        self.t0 = time.perf_counter() if clock_origin is None else clock_origin
        self.call_index = call_index
        n_out = len(plan.partition.outputs)
        self.results: List[list] = [[None] * n_out for _ in micro_inputs]
        n = plan.partition.num_stages
        self.accumulators = {(r, s): [None] * len(plan.trainable[s])
                             for r in range(replicas) for s in range(n)}
        self.events: List[List[Event]] = []
        self.error: Optional[BaseException] = None
        self._error_lock = threading.Lock()
        self.steps_done = 0
        self._stepping = False
        self._interrupted = False

    # -- the work of one action ------------------------------------------------
    def _index(self, a: Action, replica: int) -> int:
        return (a.iteration * self.schedule.micro_batches + a.micro_batch) * self.replicas + replica

    def forward(self, a: Action, replica: int, stash: dict) -> Tuple[float, float]:
        """Run a stage's forward of one micro-batch.

        Returns (inputs all received, outputs computed): the measured span is
        the work, not the wait for the previous stage.
        """
        plan = self.plan
        stage = plan.partition.stages[a.stage]
        device = plan.device_of(a.stage)
        k = self._index(a, replica)
        inputs = self.micro_inputs[k]
        args = []
        for pos, ref in enumerate(stage.args):
            if ref.kind == "input":
                v = inputs[plan.tensor_inputs[ref.index]]
                if v.device != device:
                    v = v.to(device)
            elif ref.kind == "stage":
                v = self.exchange.take(("A", a.stage, pos, a.iteration, a.micro_batch, replica))
                if isinstance(v, torch.Tensor):
                    needs_grad = plan.training and v.requires_grad
                    v = v.detach()
                    if v.device != device:
                        v = v.to(device)
                    if needs_grad:
                        v.requires_grad_()
            else:
                v = ref.value
            args.append(v)
        ready = time.perf_counter()
        out = plan.module_for(a.stage, replica)(*args)
        outs = out if stage.tuple_output else (out,)
        row = self.results[k]
        for j, item in plan.host_outputs[a.stage]:
            v = outs[item]
            row[j] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
        if plan.training:
            stash[(a.stage, a.iteration, a.micro_batch)] = (args, outs)
        if device.type == "cuda" and plan.record:
            torch.cuda.synchronize(device)  # GPU work is asynchronous: time the work, not the launch
        end = time.perf_counter()  # before publishing: a consumer never starts before this
        for consumer, pos, item in plan.consumers[a.stage]:
            self.exchange.put(("A", consumer, pos, a.iteration, a.micro_batch, replica), outs[item])
        return ready, end

    def backward(self, a: Action, replica: int, stash: dict) -> Tuple[float, float]:
        """Backpropagate one micro-batch through a stage; returns (gradients received, done)."""
        plan = self.plan
        s = a.stage
        args, outs = stash.pop((s, a.iteration, a.micro_batch))
        incoming: Dict[int, torch.Tensor] = {}
        for consumer, pos, item in plan.consumers[s]:
            src = outs[item]
            if isinstance(src, torch.Tensor) and src.requires_grad:
                g = self.exchange.take(("G", s, consumer, pos, a.iteration, a.micro_batch, replica))
                if g is not None:
                    if g.device != src.device:  # the consumer ran on another device
                        g = g.to(src.device)
                    incoming[item] = incoming[item] + g if item in incoming else g
        ready = time.perf_counter()
        seeds = [outs[i] for i in incoming]
        grads = [incoming[i] for i in incoming]
        if s == plan.loss_stage:
            loss = outs[plan.loss_item]
            if loss.requires_grad:
                seeds.append(loss)
                # loss scaling (PopTorch's optimiser argument): scaled here, unscaled at the step
                grads.append(torch.full_like(loss, self.loss_scaling))
        diff_inputs = [(pos, v) for pos, v in enumerate(args)
                       if isinstance(v, torch.Tensor) and v.requires_grad]
        params = plan.trainable[s]
        targets = [v for _, v in diff_inputs] + params
        if seeds and targets:
            result = torch.autograd.grad(seeds, targets, grads, allow_unused=True)
        else:
            result = [None] * len(targets)
        acc = self.accumulators[(replica, s)]
        for i, g in enumerate(result[len(diff_inputs):]):
            if self.anchors is not None:  # before accumulation changes g in place
                self.anchors.gradient(self._index(a, replica), s, i, params[i], g)
            if g is not None:
                if self.float32_accumulation and g.dtype in LOW_PRECISION:
                    g = g.float()  # accumulate half-precision gradients in float32
                if acc[i] is None:
                    acc[i] = g
                else:
                    acc[i].add_(g)
        if plan.record and params and params[0].device.type == "cuda":
            torch.cuda.synchronize(params[0].device)
        end = time.perf_counter()
        stage_args = plan.partition.stages[s].args
        for (pos, _), g in zip(diff_inputs, result):
            ref = stage_args[pos]
            if ref.kind == "stage":
                self.exchange.put(("G", ref.index, s, pos, a.iteration, a.micro_batch, replica), g)
        return ready, end

    def step(self, iteration: int) -> None:
        """Combine accumulated gradients (Mean or Sum) and step the optimiser once."""
        plan = self.plan
        t_start = time.perf_counter()
        window = self.schedule.micro_batches * self.replicas
        scale = (1.0 / window if plan.reduction == ReductionType.Mean else 1.0) / self.loss_scaling
        grads: Dict[int, Tuple[torch.nn.Parameter, torch.Tensor]] = {}
        for s in range(plan.partition.num_stages):
            for r in range(self.replicas):
                acc = self.accumulators[(r, s)]
                for i, g in enumerate(acc):
                    if g is None:
                        continue
                    p = plan.trainable[s][i]
                    if g.device != p.device:
                        g = g.to(p.device)
                    if id(p) in grads:
                        grads[id(p)][1].add_(g)
                    else:
                        grads[id(p)] = (p, g)
                    acc[i] = None
        transfers = []
        self._stepping = True  # Ctrl-C now waits until the weights are consistent again
        params = [p for p, _ in grads.values()]
        try:
            with _float32_update(params):
                for p, g in grads.values():
                    g = g.float() if g.dtype in LOW_PRECISION else g  # unscale in float32
                    p.grad = g.mul_(scale) if scale != 1.0 else g
                if plan.offload_optimizer:
                    transfers += _move_optimizer_state(self.optimizer, to_host=False)
                t_opt = time.perf_counter()
                self.optimizer.step()
                t_end = time.perf_counter()
                for p in params:
                    p.grad = None
            if self.anchors is not None:
                self.anchors.step_done(iteration)
            if plan.offload_optimizer:
                transfers += _move_optimizer_state(self.optimizer, to_host=True)
        finally:
            self._stepping = False
        self.steps_done += 1
        if self._interrupted:
            raise KeyboardInterrupt
        if plan.record:
            events = []
            for r in range(self.replicas):
                for st in plan.partition.stages:
                    events.append(Event(st.index, "step", -1, t_opt - self.t0, t_end - self.t0,
                                        st.ipu, r, iteration, self.call_index))
            for a, b in transfers:
                events.append(Event(-1, "transfer", -1, a - self.t0, b - self.t0, -1, 0,
                                    iteration, self.call_index))
            if t_opt - t_start > 0:
                events.append(Event(-1, "host", -1, t_start - self.t0, t_opt - self.t0, -1, 0,
                                    iteration, self.call_index))
            self.events.append(events)

    # -- lanes -------------------------------------------------------------------
    def _run_actions(self, actions: Sequence[Action], replica: int, stash: dict,
                     events: List[Event]) -> None:
        plan = self.plan
        record = plan.record
        ipus = self.schedule.stage_ipus
        t0 = self.t0
        exchange = self.exchange
        for a in actions:
            if exchange.aborted:
                raise Aborted()
            try:
                if a.kind == FORWARD:
                    start, end = self.forward(a, replica, stash)
                elif a.kind == BACKWARD:
                    start, end = self.backward(a, replica, stash)
                else:
                    continue  # the host steps, after the flush
            except (Aborted, KeyboardInterrupt):
                raise
            except BaseException as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"(ipukit: raised by virtual IPU {ipus[a.stage]}, replica "
                                 f"{replica}, running {a} — {KIND_NAMES[a.kind]} of micro-batch "
                                 f"{a.micro_batch} on stage {a.stage}, iteration {a.iteration})")
                raise
            if record:
                events.append(Event(a.stage, KIND_NAMES[a.kind], a.micro_batch, start - t0,
                                    end - t0, ipus[a.stage], replica, a.iteration,
                                    self.call_index))

    def _fail(self, exc: BaseException) -> None:
        with self._error_lock:
            if self.error is None and not isinstance(exc, Aborted):
                self.error = exc
        self.exchange.abort()

    def run(self) -> None:
        """Execute the whole call; raises the first worker error after stopping all workers."""
        lanes = self.schedule.lanes
        workers = len(lanes) * self.replicas
        with _interrupts_wait_for_steps(self):
            if workers == 1:
                self._run_inline()
            else:
                self._run_threads(workers)

    def _grad_mode(self):
        return torch.enable_grad() if self.plan.training else torch.no_grad()

    def _run_inline(self) -> None:
        """A single worker runs on the calling thread (no hand-offs at all)."""
        events: List[Event] = []
        stash: dict = {}
        self.events.append(events)
        threads = self.plan.threads_per_worker
        previous = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            with self._grad_mode():
                for it in range(self.schedule.iterations):
                    for lane in self.schedule.iteration_lanes(it):
                        self._run_actions(lane, 0, stash, events)
                    if self.plan.training:
                        self.step(it)
        finally:
            if threads:
                torch.set_num_threads(previous)

    def _run_threads(self, workers: int) -> None:
        """One thread per (replica, lane); the calling thread steps between iterations.

        The calling thread only ever waits with short timeouts, so Ctrl-C (a
        KeyboardInterrupt in the main thread) is seen promptly; it then stops
        the workers between actions and joins them.
        """
        schedule = self.schedule
        training = self.plan.training
        iterations = schedule.iterations if training else 1
        go = [threading.Event() for _ in range(iterations)]
        finished = threading.Semaphore(0)
        threads_each = self.plan.threads_per_worker or default_threads(workers)
        exchange = self.exchange

        def work(lane_index: int, replica: int, events: List[Event]) -> None:
            torch.set_num_threads(threads_each)
            stash: dict = {}
            lane = schedule.lanes[lane_index]
            try:
                with self._grad_mode():
                    for it in range(iterations):
                        go[it].wait()
                        if exchange.aborted:
                            return
                        actions = ([a for a in lane if a.iteration == it and a.kind != STEP]
                                   if training else lane)
                        self._run_actions(actions, replica, stash, events)
                        finished.release()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._fail(exc)

        threads = []
        for replica in range(self.replicas):
            for li, ipu in enumerate(schedule.lane_ipus):
                events: List[Event] = []
                self.events.append(events)
                name = f"ipukit-ipu{ipu if ipu is not None else 'all'}-replica{replica}"
                threads.append(threading.Thread(target=work, args=(li, replica, events),
                                                name=name, daemon=True))
        for t in threads:
            t.start()
        try:
            for it in range(iterations):
                go[it].set()
                done = 0
                while done < workers:
                    if finished.acquire(timeout=0.05):
                        done += 1
                    elif exchange.aborted:
                        break
                if exchange.aborted:
                    break
                if training:
                    self.step(it)
        except BaseException as exc:  # KeyboardInterrupt, or a failed step
            self._fail(exc)
        finally:
            if self.error is not None:
                exchange.abort()
            for event in go:
                event.set()
            for t in threads:
                while t.is_alive():
                    t.join(timeout=0.05)
        if self.error is not None:
            raise self.error

    def timeline(self, samples: int) -> Timeline:
        events = sorted((e for lane in self.events for e in lane), key=lambda e: (e.start, e.ipu))
        meta = dict(self.schedule.describe())
        meta.update({"schedule": self.schedule.kind, "replicas": self.replicas, "samples": samples, "training": self.plan.training,
                     "call": self.call_index})
        return Timeline(events, modeled=False, meta=meta)
