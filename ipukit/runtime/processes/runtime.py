"""Stages as processes: ipukit's partition and schedule run by torch.distributed.pipelining.

Under ``torchrun`` (or ``ipukit-run``) a model whose options say there are several processes
(``Options.Distributed.numProcesses > 1``) runs here instead of on threads:

* the processes form a (dp, pp) mesh: rank ``r`` is replica ``r // pp`` and virtual IPU
  ``sorted(ipus)[r % pp]``;
* each process builds a :class:`~torch.distributed.pipelining.PipelineStage` for every stage
  on its virtual IPU from ipukit's partition (a stage reads the model inputs it needs from
  the micro-batch, and carries skip connections through the stages in between);
* ipukit's schedule (:meth:`~ipukit.schedules.Schedule.to_torch`) runs on torch's
  ``_PipelineScheduleRuntime``, one ``step()`` per iteration;
* replicas combine gradients by DDP or one all-reduce
  (:func:`~ipukit.runtime.processes.replicas.gradient_sync`), start each call from replica
  0's buffers, and every process steps the optimiser on its own stages' weights;
* with memory tracked, each process measures its virtual IPU and process 0's timeline
  carries every process's track.

:func:`maybe_run` is the entry point the model wrapper needs; what it reads of the compiled
model goes through :func:`_compiled`.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from ..._torch import pytree

from ...core import batching as microbatch
from ...core.enums import ReductionType
from .. import memory_track
from ..gpu_clock import GpuClock
from ...timeline.events import Event, Timeline
from ..contract import StateSnapshot, abort_call, action_event, gradient_scale, step, step_events
from .exchange import RowExchange, SpanGather
from .group import (DistributedError, device_for, is_comm_error, note_failure, peer_failure, ensure_process_group, is_active, teardown_process_group, default_store)
from .watchdog import ProcessWatchdog
from .replicas import ALL_REDUCE, DDP, gradient_sync, sum_over_replicas, under_ddp
from .stages import (CallContext, StageBody, carry_plan, process_lanes, receive_buffers,
                     schedule_runner, timed_stage_class)

__all__ = ["NOT_DISTRIBUTED", "DistributedError", "is_active", "ensure_process_group",
           "maybe_run", "synchronize_weights", "last_timeline", "timeline_source",
           "expected_processes"]

#: Returned by :func:`maybe_run` when the model is not distributed (run it on threads).
NOT_DISTRIBUTED = object()


@dataclass
class Compiled:
    """What the distributed runtime reads of a compiled model."""

    partition: Any
    schedule: Any
    batching: microbatch.Batching     # the whole run's (replicas = replicationFactor)
    output_mode: Any
    output_period: int
    training: bool
    optimizer: Any
    options: Any
    tensor_inputs: List[int]
    reduction: ReductionType
    record: bool
    loss_stage: Optional[int]
    loss_item: int
    host_outputs: List[List[Tuple[int, int]]]
    input_names: List[str]
    program: Any                      # the Program itself: what measured memory reads


def _compiled(model) -> Compiled:
    """The compiled state of ``model`` (a PoplarExecutor), read through its public face."""
    program = model.program
    return Compiled(partition=program.partition, schedule=program.schedule,
                    batching=program.batching, output_mode=program.output_mode,
                    output_period=program.output_period, training=program.training,
                    optimizer=model.optimizer, options=model.options,
                    tensor_inputs=list(program.tensor_inputs), reduction=program.reduction,
                    record=program.record, loss_stage=program.loss_stage,
                    loss_item=program.loss_item, host_outputs=program.host_outputs,
                    input_names=list(program.input_names), program=program)


def _compile(model, args, kwargs) -> None:
    """Compile ``model`` for one process's share of a call (the inputs repeated once per replica,
    since the model compiles for the whole run's batching).
    """
    replicas = model.options.replication_factor

    def widen(v):
        if replicas > 1 and isinstance(v, torch.Tensor) and v.dim() > 0:
            return torch.cat([v] * replicas)
        return v

    args, kwargs = pytree.tree_map(widen, (args, kwargs))
    model.compile(*args, **kwargs)


def _fingerprint(c: Compiled, flat_inputs: Sequence) -> Dict[str, Any]:
    """What must be equal on every process of the run."""
    opts = c.options.toDict()
    opts.pop("ignored", None)
    return {
        "options": repr(sorted(opts.items())),
        "stages": [(st.ipu, list(st.blocks), [tuple(p.shape) for p in st.parameters])
                   for st in c.partition.stages],
        "schedule": c.schedule.to_strings() if c.schedule.iterations <= 1 else
        [[str(a) for a in lane if a.iteration == 0] for lane in c.schedule.lanes],
        "inputs": [(tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v)
                   for v in flat_inputs],
        "training": c.training,
    }


def _check_same_everywhere(c: Compiled, flat_inputs: Sequence, world: int) -> None:
    """Every process must see the same model, options and input shapes (a collective)."""
    import torch.distributed as dist

    prints = [None] * world
    dist.all_gather_object(prints, _fingerprint(c, flat_inputs))
    for r, fp in enumerate(prints):
        for key in prints[0]:
            if fp[key] != prints[0][key]:
                raise DistributedError(
                    f"ipukit: process {r} compiled a different model than process 0: its "
                    f"{key} differ ({_short(fp[key])} vs {_short(prints[0][key])}). Every "
                    "process must build the same model, Options and input batch sizes.")


def _check_untied(part) -> None:
    owners: Dict[int, int] = {}
    for st in part.stages:
        for p in st.parameters:
            if owners.setdefault(id(p), st.ipu) != st.ipu:
                raise DistributedError(
                    "ipukit: a parameter is used by stages on two virtual IPUs (tied "
                    "weights); as processes those would be two copies. Put the stages "
                    "that share it on one IPU, or run without ipukit-run.")


class _Layout:
    """Where this process sits in the (dp, pp) mesh: its replica, virtual IPU, stages, device."""

    def __init__(self, c: Compiled) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        part = c.partition
        ipus = part.ipus
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.pp, self.dp = len(ipus), c.batching.replicas
        self.replica, self.pp_rank = divmod(self.rank, self.pp)
        self.ipu = ipus[self.pp_rank]
        self.device = device_for(c.options, self.ipu)
        mesh = init_device_mesh("cuda" if self.device.type == "cuda" else "cpu",
                                (self.dp, self.pp), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.mine = [st.index for st in part.stages if st.ipu == self.ipu]
        self.stage_rank = {st.index: ipus.index(st.ipu) for st in part.stages}
        self.lanes = process_lanes(c.schedule, ipus)


class _Recorder:
    """This process's measured spans, against one clock shared by every process (set as they leave
    a barrier together); on CUDA the spans are CUDA events resolved once per call.
    """

    def __init__(self, c: Compiled, layout: _Layout) -> None:
        import torch.distributed as dist

        self.compiled = c
        self.layout = layout
        self.on = c.record
        self.events: List[Event] = []
        self.call_index = 0
        self.iteration = 0
        #: builds the last call's timeline (once, when first called; see finish)
        self.last: Optional[Callable[[], Timeline]] = None
        self.clock = GpuClock() if self.on and layout.device.type == "cuda" else None
        dist.barrier()
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start(self) -> Any:
        """An action's start: a CUDA event when recording on CUDA, else the host clock."""
        return time.perf_counter() if self.clock is None else self.clock.mark(self.layout.device)

    def span(self, stage: int, kind: str, micro_batch: int, start: Any) -> None:
        """Record the action that began at ``start`` (from :meth:`start`) and ends now."""
        if not self.on:
            return
        lay, clock = self.layout, self.clock
        if clock is None:
            end = time.perf_counter()
        else:  # a placeholder (the event appended next), its times written by resolve()
            clock.later(self.events, len(self.events), lay.device, start, clock.mark(lay.device))
            start = end = self.t0
        self.events.append(action_event(stage, kind, micro_batch, start - self.t0,
                                        end - self.t0, lay.ipu, lay.replica, self.iteration,
                                        self.call_index))

    def resolve(self) -> None:
        """The times of this call's CUDA-event spans (one synchronisation of the device)."""
        if self.clock is not None:
            self.clock.resolve(self.t0)

    def step(self, t_start: float, t_opt: float, t_end: float) -> None:
        """The optimiser step of this process's stages (and the gradient scaling before it)."""
        if not self.on:
            return
        lay = self.layout
        self.events += step_events([(s, lay.ipu) for s in lay.mine], [lay.replica],
                                   self.iteration, self.call_index, t_start, t_opt, t_end,
                                   t0=self.t0)

    def finish(self, parts: Callable[[], list], flat: Sequence) -> None:
        """This call's timeline, built from ``parts`` when first read (most are never read)."""
        samples = next((v.shape[0] for v in flat if isinstance(v, torch.Tensor) and v.dim() > 0),
                       0)
        call, built = self.call_index, []

        def build() -> Timeline:
            if not built:
                built.append(self._build(parts, samples, call))
            return built[0]

        self.last = build

    @property
    def timeline(self) -> Optional[Timeline]:
        """The last call's :class:`Timeline` (None before one)."""
        return None if self.last is None else self.last()

    def _build(self, parts: Callable[[], list], samples: int, call: int) -> Timeline:
        c, lay, parts = self.compiled, self.layout, parts()
        start = min(p[1] for p in parts)
        events = [e._replace(start=e.start - start, end=e.end - start)
                  for p in parts for e in p[0]]
        events.sort(key=lambda e: (e.start, e.replica, e.ipu))
        memory = sorted((m.shifted(-start) for p in parts for m in p[2]),
                        key=lambda m: (m.replica, m.ipu))
        meta = dict(c.schedule.describe())
        meta.update({"schedule": c.schedule.kind, "replicas": lay.dp, "samples": samples,
                     "training": c.training, "call": call,
                     "model": c.options.model_name or ("training" if c.training else "inference"),
                     "stage_ipus": list(c.schedule.stage_ipus),
                     "blocks": [st.blocks for st in c.partition.stages],
                     "processes": lay.world, "rank": lay.rank,
                     "gathered": lay.rank == 0})
        return Timeline(events, modeled=False, meta=meta, memory=memory)


class _Runtime:
    """This process's part of a distributed model: its stages, torch's schedule runtime, groups."""

    watchdog: Optional[ProcessWatchdog] = None   # set when Options.stallTimeout is on

    def __init__(self, model, flat_inputs: Sequence) -> None:
        c = self.compiled = _compiled(model)
        part = c.partition
        lay = self.layout = _Layout(c)
        _check_same_everywhere(c, flat_inputs, lay.world)
        self.device = lay.device
        # every process starts from the weights and buffers of each stage's process in
        # replica 0 (which may have trained them through another model of this module)
        _broadcast_stages(part, self.device)
        for s in lay.mine:
            part.stages[s].module.to(self.device)
        self.params = [p for s in lay.mine for p in part.stages[s].parameters if p.requires_grad]
        _check_untied(part)
        self.buffers = [b for s in lay.mine for b in part.stages[s].module.buffers()]
        # a failed or interrupted call leaves this process's stages as they were (as on threads)
        self.own = torch.nn.ModuleList(part.stages[s].module for s in lay.mine)
        self.snapshot = StateSnapshot()          # buffers (and weights, unless copied later)
        self.weights = StateSnapshot()           # weights and optimiser state, copied later
        self.weights_due = self.weights_taken = False
        #: how the replicas combine gradients: DDP, ALL_REDUCE, or None (one replica)
        self.replica_sync = gradient_sync(c.schedule, lay.dp, c.training)
        self.M = c.schedule.micro_batches
        steps = self.M * c.schedule.iterations
        self.recorder = _Recorder(c, lay)
        chosen = set(microbatch.returned_steps(c.output_mode, c.output_period, steps))
        self.ctx = CallContext([k in chosen for k in range(steps)], self.recorder.span,
                               self.recorder.start)
        carry = carry_plan(part)
        n = part.num_stages
        stage_cls = timed_stage_class()
        self.stages = []
        for s in lay.mine:
            body = StageBody(c, self.ctx, s, carry[s], carry[s + 1] if s + 1 < n else [],
                             self.device)
            if self.replica_sync == DDP:
                body = under_ddp(body, lay.dp_group, self.device)
            stage = stage_cls(body, s, n, self.device, group=lay.pp_group)
            stage._ipukit_ctx = self.ctx
            self.stages.append(stage)
        self.loss_scaling = float((getattr(c.optimizer, "ipu_arguments", None) or {})
                                  .get("loss_scaling", 1.0)) if c.training else 1.0
        scaling = self.loss_scaling

        def loss_fn(output, target):
            loss = output if output.dim() == 0 else output.sum()
            return loss * scaling if scaling != 1.0 else loss

        producers = sorted({lay.stage_rank[s] for s in range(n) if c.host_outputs[s]})
        self.exchange = RowExchange(producers, lay.pp_group, lay.pp_rank)
        # at most: every action of an iteration, a step per stage and the host's span, per iteration
        per_iteration = sum(len(lane) for lane in lay.lanes) + n + 1
        self.spans = SpanGather(per_iteration * c.schedule.iterations, lay.world, lay.rank)
        #: stops a call in which no process completed an action for Options.stallTimeout
        if c.options.stall_timeout:
            self.watchdog = ProcessWatchdog(c.options.stall_timeout, self.ctx, lay, n,
                                            default_store())
        self.runner = schedule_runner(c.schedule, c.training, self.stages, lay.stage_rank,
                                      lay.lanes, loss_fn)
        if c.training:
            self.ctx.idle_after = idle_point(lay.lanes[lay.pp_rank])
            self.ctx.idle = self._copy_weights
        self._target = torch.zeros(1, device=self.device)  # torch wants a target; the loss is the model's

    @property
    def timeline(self) -> Optional[Timeline]:
        """The last call's measured timeline (every process's spans on process 0)."""
        return self.recorder.timeline

    def run(self, flat: list) -> Any:
        """One call: this replica's outputs; on a failure anywhere, or an interrupt, this process's
        weights, buffers and optimiser state are restored.
        """
        c = self.compiled
        # weights change only at the optimiser step: where this process soon waits for a
        # peer anyway, they are copied then (see idle_point), else now with the buffers
        later = c.training and self.ctx.idle_after is not None
        snapshot = self.snapshot.capture(self.own, c.optimizer, c.training and not later)
        self.weights_due, self.weights_taken = later, False
        try:
            if self.watchdog is not None:
                self.watchdog.begin(self.recorder.call_index)
            return self._run(flat)
        except BaseException:
            def restore() -> None:
                if self.weights_taken:
                    self.weights.restore()
                snapshot.restore()

            # the one abort path; this process's work has already stopped (the peers learn
            # of the failure through the group), so there is nothing left to join here
            abort_call(lambda: None, lambda _deadline: [], restore)
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.end()

    def _copy_weights(self) -> None:
        """This call's copy of the weights and optimiser state, if still due."""
        if self.weights_due:
            self.weights_due = False
            with memory_track.untracked():   # the host's undo copy, as on threads
                self.weights.capture(self.own, self.compiled.optimizer, True, buffers=False)
            self.weights_taken = True

    def _run(self, flat: list) -> Any:
        import torch.distributed as dist

        c, lay, ctx, rec = self.compiled, self.layout, self.ctx, self.recorder
        b = c.batching
        local = microbatch.Batching(b.device_iterations, b.gradient_accumulation, 1)
        micro = microbatch.split(flat, local, c.input_names)
        if lay.dp > 1 and self.buffers:  # replicas start each call from replica 0's buffers
            with torch.no_grad():
                for buf in self.buffers:
                    dist.broadcast(buf.data, group=lay.dp_group, group_src=0)
        t_call = rec.now()
        rec.events = []
        ctx.rows = {}
        M, last = self.M, c.schedule.iterations - 1
        memory = self._memory(micro)
        with torch.enable_grad() if c.training else torch.no_grad():
            for it in range(last + 1):
                ctx.iteration = rec.iteration = it
                ctx.offset = it * M
                ctx.inputs = micro[it * M:(it + 1) * M]
                if c.training:
                    for p in self.params:
                        p.grad = None
                # torch's runtime runs every action of this process on this thread
                with (contextlib.nullcontext() if memory is None
                      else memory.thread(lay.replica, lay.ipu)):
                    target = {"target_mbs": [self._target] * M} if c.training else {}
                    self.runner.step(arg_mbs=[()] * M, kwarg_mbs=[{}] * M,
                                     return_outputs=False, **target)
                if it == last:  # the replica's rows travel while the optimiser steps
                    rows_of_replica = self.exchange.start(ctx.rows)
                if c.training:
                    if self.replica_sync == ALL_REDUCE:
                        sum_over_replicas(self.params, lay.dp_group)
                    self._step()
                    if memory is not None:
                        memory.after_step()
        rec.resolve()  # this process's spans as times
        tracks = None if memory is None else memory.finish()
        # process 0's timeline: every process's spans (and memory), gathered while the rows arrive
        spans = self.spans.start(rec.events, t_call, tracks) if rec.on else None
        rows = rows_of_replica()  # every process of the replica: the replica's rows
        result = _call_outputs(c, rows, micro, ctx.returned, local)
        if spans is not None:
            rec.finish(spans(), flat)  # the timeline itself is built when it is read
        rec.call_index += 1
        return result

    def _memory(self, micro: List[list]) -> Optional[memory_track.CallMemory]:
        """This call's memory account of this process's virtual IPU when memory is tracked, else None
        (the baseline holds torch's receive buffers).
        """
        c, lay = self.compiled, self.layout
        if not (self.recorder.on and memory_track.tracking(c.program)):
            return None
        account = (lay.replica, lay.ipu)
        return memory_track.CallMemory(
            c.program, c.schedule, lay.dp, c.optimizer if c.training else None,
            self.recorder.t0, micro, accounts=[account], devices={lay.ipu: lay.device},
            kept={account: {"receive_buffers": receive_buffers(self.stages)}})

    def _step(self) -> None:
        """Apply PopTorch's Mean/Sum over micro-batches and replicas, step this process's weights."""
        c = self.compiled
        t_start = time.perf_counter()
        self._copy_weights()  # in case no forward named by idle_point ran
        scale = gradient_scale(c.reduction, self.M * self.layout.dp, self.loss_scaling,
                               averaged=self.layout.dp if self.replica_sync == DDP else 1)
        grads = {i: (p, p.grad) for i, p in enumerate(self.params) if p.grad is not None}
        t_opt, t_end, _ = step(c.optimizer, grads, scale, offload=False)   # the threads' own
        for p in self.params:
            p.grad = None
        self.recorder.step(t_start, t_opt, t_end)


def idle_point(lane: Sequence) -> Optional[Tuple[int, int]]:
    """(stage, micro-batch) of the forward after which this process first waits for a peer: the
    undo copy of the weights goes there, off the critical path (None: copy at once).
    """
    last = None
    for a in lane:
        if a.kind != "F" or a.stage != 0:
            break
        last = (a.stage, a.micro_batch)
    return last


def _call_outputs(c: Compiled, rows: Dict[int, Dict[int, Any]], micro: List[list],
                  returned: List[bool], local: microbatch.Batching):
    """The call's outputs in the model's structure, from the stages' rows (per micro-batch)."""
    part, table = c.partition, []
    n_out = len(part.outputs)
    for k in range(len(micro)):
        row = [None] * n_out
        if not returned[k]:  # gather() never reads it: any placeholder will do
            table.append(table[-1] if table else row)
            continue
        for j, v in rows.get(k, {}).items():
            row[j] = v
        for j, ref in enumerate(part.outputs):
            if ref.kind == "const":
                row[j] = ref.value
            elif ref.kind == "input":
                row[j] = micro[k][c.tensor_inputs[ref.index]]
        table.append(row)
    flat_out = microbatch.gather(table, c.output_mode, c.output_period, local)
    return pytree.tree_unflatten(flat_out, part.out_spec)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def expected_processes(model) -> int:
    c = _compiled(model)
    return len(c.partition.ipus) * c.batching.replicas


def _check_supported(model) -> None:
    """What the threaded executor does that processes do not (yet): a clear error, not a silent change."""
    c = _compiled(model)
    if c.options.anchored_tensors and c.training:
        raise DistributedError(
            "Options.anchorTensor: anchored tensors are not supported when stages run as "
            "processes yet; remove the anchors, or run in one process "
            "(Options.Distributed.disable()).")
    low = [n for n, p in model.model.named_parameters()
           if p.dtype in (torch.float16, torch.bfloat16)]
    if low and c.training:
        raise DistributedError(
            f"half-precision weights ({low[0]}, ...): training them as processes (float32 "
            "updates, loss scaling) is not supported yet; train in float32, or run in one "
            "process (Options.Distributed.disable()).")


def maybe_run(model, args: tuple, kwargs: dict):
    """Run one call of ``model`` (a PoplarExecutor) on processes, or return
    :data:`NOT_DISTRIBUTED` when its options configure one process.
    """
    opts = model.options
    if not is_active(opts):
        return NOT_DISTRIBUTED
    state = model.runtime_state
    rt = state.get("processes")
    flat, spec = pytree.tree_flatten((args, kwargs))
    started = time.time()
    try:
        ensure_process_group(opts)
        if rt is None or model.program is None:
            if model.program is None:
                _compile(model, args, kwargs)
            need = expected_processes(model)
            if need != opts.Distributed.numProcesses:
                c = _compiled(model)
                raise DistributedError(
                    f"ipukit: this model runs as {need} processes ({len(c.partition.ipus)} "
                    f"virtual IPU(s) × replicationFactor {c.batching.replicas}), but the run "
                    f"has {opts.Distributed.numProcesses} (WORLD_SIZE). Launch it with "
                    f"`ipukit-run --nproc {need} ...`, or change the Stages / "
                    "replicationFactor.")
            _check_supported(model)
            rt = _Runtime(model, flat)
            state["processes"] = rt
        return rt.run(flat)
    except DistributedError as exc:
        _raise_if_stalled(state, exc)
        if not getattr(exc, "_peer", False):
            note_failure(exc)
        raise
    except BaseException as exc:
        _raise_if_stalled(state, exc)
        if is_comm_error(exc):
            cause = peer_failure(started - 1.0)
            me = opts.Distributed.processId
            if cause is None:  # nobody raised: a process ended without an error (killed?)
                err = DistributedError(
                    f"ipukit: process {me} lost contact with the other processes "
                    f"({type(exc).__name__}: {_short(str(exc))}) and no process reported an "
                    "error: one was probably killed (out of memory, a signal); torchrun's "
                    "report names it.")
                err._peer = True
                raise err from exc
            if not cause.startswith(f"rank {me}:"):
                who, _, what = cause.partition(": ")
                err = DistributedError(f"ipukit: {who.replace('rank', 'process')} failed "
                                       f"({what}), so process {me} stopped too; see that "
                                       "process's error above.")
                err._peer = True
                raise err from exc
        note_failure(exc)
        if hasattr(exc, "add_note"):
            exc.add_note(f"(ipukit: raised by process {opts.Distributed.processId} of {opts.Distributed.numProcesses})")
        raise


def _raise_if_stalled(state: dict, exc: BaseException) -> None:
    """After the watchdog stopped a call (restored already): tear the process group down,
    forget this model's runtime (the next call builds both afresh), raise its StallError."""
    rt = state.get("processes")
    fired = None if rt is None or rt.watchdog is None else rt.watchdog.verdict(
        is_comm_error(exc))
    if fired is None:
        return
    state.pop("processes", None)
    rt.watchdog.close()
    teardown_process_group()
    if exc is fired:
        raise fired
    raise fired from exc


def _runtime_of(model) -> Optional[_Runtime]:
    """The runtime of ``model`` (a PoplarExecutor, or ipukit.distributed's wrapper of one)."""
    return getattr(model, "runtime_state", {}).get("processes")


def timeline_source(model) -> Optional[Callable[[], Optional[Timeline]]]:
    """What builds the timeline of ``model``'s last call on processes, when it is read
    (None when timelines are not recorded)."""
    rt = _runtime_of(model)
    return None if rt is None or not rt.recorder.on else rt.recorder.last


def last_timeline(model) -> Optional[Timeline]:
    """The measured timeline of ``model``'s last call on processes (None before one, or when
    timelines are not recorded): every process's spans on process 0, its own elsewhere."""
    rt = _runtime_of(model)
    return None if rt is None else rt.timeline


def synchronize_weights(model) -> None:
    """Give every process every stage's current weights and buffers (a collective: call it on
    every process before saving or evaluating the whole model on one).
    """
    rt = _runtime_of(model)
    if rt is not None:
        _broadcast_stages(rt.compiled.partition, rt.device)


def _broadcast_stages(part, device: torch.device) -> None:
    """Each stage's weights and buffers from its process in replica 0 to every process."""
    import torch.distributed as dist

    ipus = part.ipus
    with torch.no_grad():
        for st in part.stages:
            owner = ipus.index(st.ipu)  # replica 0's process of that IPU
            for t in list(st.module.parameters()) + list(st.module.buffers()):
                moved = t.data.to(device)
                dist.broadcast(moved, src=owner)
                t.data.copy_(moved.to(t.device))
