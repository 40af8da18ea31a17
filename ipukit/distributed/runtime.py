"""Stages as processes: ipukit's partition and schedule run by torch.distributed.pipelining.

Under ``torchrun`` (or ``ipukit-run``) every process runs the user's script; a
training or inference model whose options say there are several processes
(``Options.Distributed.numProcesses > 1``, read from torchrun's ``WORLD_SIZE``)
runs here instead of on threads:

* processes form a (dp, pp) device mesh: ``dp`` = replicationFactor (data-parallel
  replicas), ``pp`` = the model's virtual IPUs; rank ``r`` is replica ``r // pp``,
  virtual IPU ``sorted(ipus)[r % pp]``;
* each process builds a :class:`~torch.distributed.pipelining.PipelineStage`
  (the manual frontend) for every stage on its virtual IPU, from ipukit's own
  partition. A stage's body reads the model inputs it needs (the labels of the
  last block) from the call's micro-batch directly, and carries tensors that a
  later stage needs (skip connections) through the stages in between, since
  torch's runtime only sends to the next stage;
* ipukit's schedule (:meth:`~ipukit.schedule.Schedule.to_torch`) is run by
  torch's ``_PipelineScheduleRuntime``, one ``step()`` per iteration;
* with replicas, each stage runs under DDP in the ``dp`` group: torch's
  pipeline stage keeps DDP from syncing until a step's last backward, then
  DDP all-reduces (averages) the gradients; PopTorch's Mean/Sum rule scales
  them, and every process steps the user's optimiser on its own stages' weights;
* replicas start each call from replica 0's buffers (a broadcast in the dp group).

:func:`maybe_run` is the one entry point the model wrapper needs; everything
it reads of the compiled model goes through :func:`_compiled`.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from .. import microbatch
from ..enums import ReductionType
from ..errors import Error
from ..timeline import Event, KIND_NAMES, Timeline

#: Returned by :func:`maybe_run` when the model is not distributed (run it on threads).
NOT_DISTRIBUTED = object()

_FAILED_KEY = "ipukit/failed"


class DistributedError(Error):
    """A multi-process run that cannot start or continue (wrong process count, mismatch, a failed peer)."""


def is_active(options) -> bool:
    """Whether models with these options run as processes (several processes configured)."""
    return options.Distributed.numProcesses > 1


# -- the one adapter onto the compiled model -----------------------------------------------

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
                    input_names=list(program.input_names))


def _is_compiled(model) -> bool:
    return model.program is not None


def _compile(model, args, kwargs) -> None:
    """Compile ``model`` for one process's share of a call.

    A process holds one replica's combined batch (micro-batch × DI × GA); the
    model compiles for the whole run's batching, so the inputs are repeated
    once per replica for the compile only (it traces one micro-batch).
    """
    replicas = model.options.replication_factor

    def widen(v):
        if replicas > 1 and isinstance(v, torch.Tensor) and v.dim() > 0:
            return torch.cat([v] * replicas)
        return v

    args, kwargs = pytree.tree_map(widen, (args, kwargs))
    model.compile(*args, **kwargs)


# -- process group ------------------------------------------------------------------------

def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("IPUKIT_DIST_TIMEOUT", "300")))


def _wants_cuda(options) -> bool:
    mapping = options.device_mapping
    if mapping:
        return any(str(d).startswith("cuda") for d in mapping)
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def ensure_process_group(options) -> None:
    """Join the run's process group (gloo on CPU; NCCL for CUDA tensors, gloo for the rest)."""
    import torch.distributed as dist

    d = options.Distributed
    if dist.is_initialized():
        if dist.get_world_size() != d.numProcesses or dist.get_rank() != d.processId:
            raise DistributedError(
                f"Options.Distributed says process {d.processId} of {d.numProcesses}, but the "
                f"process group is rank {dist.get_rank()} of {dist.get_world_size()}: build "
                "the Options inside the launched script (torchrun sets RANK/WORLD_SIZE), or "
                "call Options.Distributed.configureProcessId(rank, world_size).")
        return
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise DistributedError(
                f"Options.Distributed: {d.numProcesses} processes are configured but {var} is "
                "not set, so there is no rendezvous to join. Launch the script with "
                "`ipukit-run --nproc N script.py` (or torchrun), or call "
                "Options.Distributed.disable() to run in one process.")
    backend = "cpu:gloo,cuda:nccl" if _wants_cuda(options) else "gloo"
    if _wants_cuda(options):
        gpus = torch.cuda.device_count()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", d.numProcesses))
        if per_node > gpus:
            raise DistributedError(
                f"ipukit: {per_node} processes on this machine but {gpus} CUDA device(s): NCCL "
                "needs a GPU per process. Launch at most that many processes per machine, or "
                "run the stages on CPU with Options.deviceMapping(['cpu']).")
        local = int(os.environ.get("LOCAL_RANK", d.processId))
        torch.cuda.set_device(local % gpus)
    try:
        dist.init_process_group(backend, rank=d.processId, world_size=d.numProcesses,
                                timeout=_timeout())
    except Exception as exc:  # noqa: BLE001 - re-raised with the setting to check
        raise DistributedError(
            f"ipukit could not join the process group at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} as rank {d.processId} of {d.numProcesses} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Launch "
            "every process with ipukit-run/torchrun and the same rendezvous.") from exc
    _install_failure_report()


def _install_failure_report() -> None:
    """An uncaught exception tells the peers (and ipukit-run) which rank failed and why."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        _note_failure(value, uncaught=True)
        previous(kind, value, tb)

    sys.excepthook = hook


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _note_failure(exc: BaseException, uncaught: bool = False) -> None:
    """Tell the peers (through the rendezvous store) that this rank failed, and why.

    Under ipukit-run, an exception that ends the process is also written to
    ``IPUKIT_FAILURE_DIR``, so the launcher names the process that failed first;
    errors a script catches (and goes on from) are not.
    """
    import torch.distributed as dist

    if isinstance(exc, DistributedError) and getattr(exc, "_peer", False):
        return  # a consequence of another rank's failure, not a cause
    rank = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))
    line = f"rank {rank}: {_describe(exc)}"
    now = time.time()
    folder = os.environ.get("IPUKIT_FAILURE_DIR")
    if folder and uncaught:
        try:
            with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
                f.write(f"{now}\n{line}\n")
        except OSError:
            pass
    try:
        dist.distributed_c10d._get_default_store().set(_FAILED_KEY, f"{now}|{line}")
    except Exception:  # noqa: BLE001 - best effort: the store may be gone
        pass


def _peer_failure(since: float, wait: float = 3.0) -> Optional[str]:
    """The failure another rank recorded after ``since``, waiting briefly for it."""
    import torch.distributed as dist

    deadline = time.monotonic() + wait
    while True:
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.check([_FAILED_KEY]):
                stamp, _, line = store.get(_FAILED_KEY).decode().partition("|")
                if float(stamp) >= since:
                    return line
        except Exception:  # noqa: BLE001
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset",
                                   "Gloo", "gloo", "NCCL", "Timed out", "timed out"))


# -- the stages ---------------------------------------------------------------------------

class _CallContext:
    """What the stage bodies of this process read during a call."""

    def __init__(self) -> None:
        self.inputs: List[list] = []        # this iteration's micro-batches (flat model inputs)
        self.rows: Dict[int, Dict[int, Any]] = {}
        self.iteration = 0
        self.micro_batch = 0
        self.offset = 0                     # micro-batch index of this iteration's first


class _StageBody(torch.nn.Module):
    """One ipukit stage as torch's pipeline sees it: received tensors in, tensors to send out.

    Positional inputs are the tensors carried from the previous stage (its own
    outputs and any earlier stage's outputs a later stage still needs); model
    inputs are read from the call's micro-batch; the last stage returns the
    loss (training), which torch's runtime backpropagates from.
    """

    def __init__(self, rt: "_Runtime", index: int, carried_in: List[Tuple[int, int]],
                 carried_out: List[Tuple[int, int]]) -> None:
        super().__init__()
        c = rt.compiled
        st = c.partition.stages[index]
        self.inner = st.module
        self._rt = rt
        self._index = index
        self._args = st.args
        self._tuple_output = st.tuple_output
        self._carried_in = carried_in
        self._carried_out = carried_out
        self._host_outputs = c.host_outputs[index]
        self._last = index == c.partition.num_stages - 1
        self._device = rt.device

    def forward(self, *carried):
        rt = self._rt
        ctx = rt.ctx
        k = ctx.micro_batch
        inputs = ctx.inputs[k]
        values = dict(zip(self._carried_in, carried))
        args = []
        for ref in self._args:
            if ref.kind == "input":
                v = inputs[rt.compiled.tensor_inputs[ref.index]]
                if isinstance(v, torch.Tensor) and v.device != self._device:
                    v = v.to(self._device)
            elif ref.kind == "stage":
                v = values[(ref.index, 0 if ref.item is None else ref.item)]
            else:
                v = ref.value
            args.append(v)
        out = self.inner(*args)
        outs = out if self._tuple_output else (out,)
        if self._host_outputs and rt.returned[ctx.offset + k]:
            row = ctx.rows.setdefault(ctx.offset + k, {})
            for j, item in self._host_outputs:
                v = outs[item]
                row[j] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
        if self._last:
            if rt.compiled.training:
                return outs[rt.compiled.loss_item]
            return torch.zeros((), device=self._device)
        mine = {(self._index, i): v for i, v in enumerate(outs)}
        sent = []
        for key in self._carried_out:
            v = mine[key] if key in mine else values[key]
            if key not in mine and isinstance(v, torch.Tensor):
                v = v.view_as(v)  # carried through: a new autograd node, gradients flow back
            sent.append(v)
        return tuple(sent)


def _carry_plan(partition) -> List[List[Tuple[int, int]]]:
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


def _timed_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage that tells its body the micro-batch and records measured spans."""

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            rt = self._ipukit_rt
            rt.ctx.micro_batch = fwd_chunk_id
            start = time.perf_counter()
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            rt.span(self.stage_index, "F", fwd_chunk_id, start)
            return out

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            rt = self._ipukit_rt
            start = time.perf_counter()
            out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            rt.span(self.stage_index, "B", bwd_chunk_id, start)
            return out

    return TimedStage


def _torch_single_order(kind: str, stage: int, num_stages: int, micro_batches: int) -> List[str]:
    """The order torch's ``Schedule1F1B``/``ScheduleGPipe`` run one stage's actions in.

    As their ``_step_microbatches`` execute it (torch 2.14): GPipe runs every
    forward, then every backward; 1F1B runs ``min(M, N − stage)`` forwards,
    then alternates a backward and a forward, then drains the backwards.
    (Their ``pipeline_order`` tables are descriptive and not what runs.)
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


def _torch_schedule(c: Compiled, stages: list, micro_batches: int, loss_fn, lanes):
    """torch's own schedule class when it runs exactly ipukit's order, else None.

    With one stage per process, ipukit's 1F1B and GPipe orders are those of
    torch's ``Schedule1F1B`` and ``ScheduleGPipe`` (checked action by action);
    those classes pair each send with the next receive in one batched
    exchange, which the general runtime does not.
    """
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    kind = c.schedule.kind
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}.get(kind)
    n = c.partition.num_stages
    if cls is None or not c.training or len(stages) != 1 or len(lanes) != n:
        return None
    ours = [[str(a) for a in lane] for lane in lanes]
    if any(ours[s] != _torch_single_order(kind, s, n, micro_batches) for s in range(n)):
        return None
    return cls(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)


def _runtime_class():
    """torch's schedule runtime, told the stage → rank mapping instead of inferring it.

    torch infers the mapping while checking that every stage has its backwards,
    which a forward-only (inference) schedule does not; ipukit's schedule was
    validated when it was built, and the mapping is the stages' virtual IPUs.
    """
    from torch.distributed.pipelining.schedules import (PipelineScheduleMulti,
                                                        _PipelineScheduleRuntime)

    class Mapping(PipelineScheduleMulti):
        def _validate_and_set_stage_mapping(self, actions) -> None:
            self.stage_index_to_group_rank = dict(self._ipukit_stage_rank)
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    class Runtime(_PipelineScheduleRuntime, Mapping):
        pass

    return Runtime


def _device_for(options, ipu: int) -> torch.device:
    mapping = options.device_mapping
    if mapping:
        return torch.device(mapping[ipu % len(mapping)])
    if _wants_cuda(options):
        local = int(os.environ.get("LOCAL_RANK", options.Distributed.processId))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


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


class _Runtime:
    """This process's part of a distributed model: its stages, torch's schedule runtime, groups."""

    def __init__(self, model, flat_inputs: Sequence) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        c = self.compiled = _compiled(model)
        part = c.partition
        opts = c.options
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        ipus = part.ipus
        self.pp = len(ipus)
        self.dp = c.batching.replicas
        # every process must see the same model, options and input shapes
        prints = [None] * self.world
        dist.all_gather_object(prints, _fingerprint(c, flat_inputs))
        for r, fp in enumerate(prints):
            for key in prints[0]:
                if fp[key] != prints[0][key]:
                    raise DistributedError(
                        f"ipukit: process {r} compiled a different model than process 0: its "
                        f"{key} differ ({_short(fp[key])} vs {_short(prints[0][key])}). Every "
                        "process must build the same model, Options and input batch sizes.")
        if c.schedule.lane_ipus == [None] or len(c.schedule.lanes) != self.pp:
            self.lanes = _per_ipu_lanes(c.schedule, ipus)
        else:
            self.lanes = [[a for a in lane if a.iteration == 0 and a.kind != "S"]
                          for lane in c.schedule.lanes]
        self.replica, pp_rank = divmod(self.rank, self.pp)
        self.ipu = ipus[pp_rank]
        self.device = _device_for(opts, self.ipu)
        mesh_type = "cuda" if self.device.type == "cuda" else "cpu"
        self.mesh = init_device_mesh(mesh_type, (self.dp, self.pp), mesh_dim_names=("dp", "pp"))
        self.pp_group = self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp")
        # every process starts from the weights and buffers of each stage's process in
        # replica 0 (which may have trained them through another model of this module)
        _broadcast_stages(part, self.device)
        self.mine = [st.index for st in part.stages if st.ipu == self.ipu]
        for s in self.mine:
            part.stages[s].module.to(self.device)
        self.params = [p for s in self.mine for p in part.stages[s].parameters if p.requires_grad]
        owners: Dict[int, int] = {}
        for st in part.stages:
            for p in st.parameters:
                if owners.setdefault(id(p), st.ipu) != st.ipu:
                    raise DistributedError(
                        "ipukit: a parameter is used by stages on two virtual IPUs (tied "
                        "weights); as processes those would be two copies. Put the stages "
                        "that share it on one IPU, or run without ipukit-run.")
        self.buffers = [b for s in self.mine for b in part.stages[s].module.buffers()]
        self.ddp = False  # set when a stage runs under DDP (replicas)
        carry = _carry_plan(part)
        n = part.num_stages
        self.ctx = _CallContext()
        stage_cls = _timed_stage_class()
        self.stages = []
        for s in self.mine:
            body = _StageBody(self, s, carry[s], carry[s + 1] if s + 1 < n else [])
            stage = stage_cls(self._replicated(body), s, n, self.device, group=self.pp_group)
            stage._ipukit_rt = self
            self.stages.append(stage)
        self.M = c.schedule.micro_batches
        self.iterations = c.schedule.iterations
        steps = self.M * self.iterations
        self.returned = _returned_micro_batches(c.output_mode, c.output_period, steps)
        loss_scaling = float((getattr(c.optimizer, "ipu_arguments", None) or {})
                             .get("loss_scaling", 1.0)) if c.training else 1.0
        self.loss_scaling = loss_scaling

        def loss_fn(output, target):
            loss = output if output.dim() == 0 else output.sum()
            return loss * loss_scaling if loss_scaling != 1.0 else loss

        self.runner = _torch_schedule(c, self.stages, self.M, loss_fn, self.lanes)
        if self.runner is None:  # ipukit's own order: torch's runtime, fed the actions
            from torch.distributed.pipelining.schedules import _Action

            self.runner = _runtime_class()(self.stages, self.M,
                                           loss_fn=loss_fn if c.training else None,
                                           scale_grads=False)
            self.runner._ipukit_stage_rank = {st.index: ipus.index(st.ipu)
                                              for st in part.stages}
            self.runner._prepare_schedule_with_comms(
                {r: [_Action.from_str(str(a)) for a in lane] for r, lane in enumerate(self.lanes)})
        self._target = torch.zeros(1, device=self.device)  # torch wants a target; the loss is the model's
        self.events: List[Event] = []
        # one clock for every process: the moment they all left this barrier (events are
        # recorded against it, and each call's timeline starts at the earliest process's call)
        dist.barrier()
        self.t0 = time.perf_counter()
        self.call_index = 0

    def _replicated(self, body: torch.nn.Module) -> torch.nn.Module:
        """With replicas, the stage under DDP in the dp group (torch's pipeline stages drive it:
        no gradient sync until a step's last backward, then one all-reduce)."""
        if self.dp == 1 or not self.compiled.training \
                or not any(p.requires_grad for p in body.parameters()):
            return body
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = True
        return DistributedDataParallel(
            body, process_group=self.dp_group, broadcast_buffers=False, init_sync=False,
            device_ids=[self.device.index] if self.device.type == "cuda" else None)

    # -- recording ----------------------------------------------------------------------------
    def span(self, stage: int, kind: str, micro_batch: int, start: float) -> None:
        if not self.compiled.record:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        self.events.append(Event(stage, KIND_NAMES[kind], micro_batch, start - self.t0,
                                 end - self.t0, self.ipu, self.replica, self.ctx.iteration,
                                 self.call_index))

    # -- one call -----------------------------------------------------------------------------
    def run(self, model, flat: list) -> Any:
        import torch.distributed as dist

        c = self.compiled
        b = c.batching
        local = microbatch.Batching(b.device_iterations, b.gradient_accumulation, 1)
        micro = microbatch.split(flat, local, c.input_names)
        if self.dp > 1 and self.buffers:  # replicas start each call from replica 0's buffers
            with torch.no_grad():
                for buf in self.buffers:
                    dist.broadcast(buf.data, group=self.dp_group, group_src=0)
        t_call = time.perf_counter() - self.t0
        self.events = []
        ctx = self.ctx
        ctx.rows = {}
        grad = torch.enable_grad() if c.training else torch.no_grad()
        M = self.M
        with grad:
            for it in range(self.iterations):
                ctx.iteration = it
                ctx.offset = it * M
                ctx.inputs = micro[it * M:(it + 1) * M]
                if c.training:
                    for p in self.params:
                        p.grad = None
                    self.runner.step(arg_mbs=[()] * M, kwarg_mbs=[{}] * M,
                                     target_mbs=[self._target] * M, return_outputs=False)
                    self._step(it)
                else:
                    self.runner.step(arg_mbs=[()] * M, kwarg_mbs=[{}] * M,
                                     return_outputs=False)
        # one exchange per call: the rows of this replica (for every process of it) and,
        # for process 0's timeline, every process's spans
        rows = ctx.rows
        mine = (rows, self.events if c.record else None, t_call)
        everyone = [mine]
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, mine)
        rows = {}
        for r in range(self.replica * self.pp, (self.replica + 1) * self.pp):
            for k, row in everyone[r][0].items():
                rows.setdefault(k, {}).update(row)
        part = c.partition
        n_out = len(part.outputs)
        table = []
        for k in range(len(micro)):
            row = [None] * n_out
            if not self.returned[k]:  # gather() never reads it: any placeholder will do
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
        result = pytree.tree_unflatten(flat_out, part.out_spec)
        if c.record:
            self._timeline(model, flat, everyone if self.rank == 0 else [mine])
        self.call_index += 1
        return result

    def _step(self, iteration: int) -> None:
        """Apply PopTorch's Mean/Sum over micro-batches and replicas, step this process's weights.

        Under DDP the gradients arrive averaged over the replicas (DDP's mean).
        """
        c = self.compiled
        t_start = time.perf_counter()
        grads = [p.grad for p in self.params if p.grad is not None]
        replicas = self.dp if self.ddp else 1  # DDP has divided by this already
        if c.reduction == ReductionType.Mean:
            scale = 1.0 / (self.M * (self.dp // replicas))
        else:
            scale = float(replicas)
        scale /= self.loss_scaling
        if scale != 1.0:
            for g in grads:
                g.mul_(scale)
        t_opt = time.perf_counter()
        c.optimizer.step()
        t_end = time.perf_counter()
        for p in self.params:
            p.grad = None
        if c.record:
            for s in self.mine:
                self.events.append(Event(s, "step", -1, t_opt - self.t0, t_end - self.t0,
                                         self.ipu, self.replica, iteration, self.call_index))
            if t_opt - t_start > 0:
                self.events.append(Event(-1, "host", -1, t_start - self.t0, t_opt - self.t0,
                                         -1, self.replica, iteration, self.call_index))

    def _timeline(self, model, flat, parts) -> None:
        c = self.compiled
        start = min(p[2] for p in parts)  # the earliest process's call starts the timeline
        events = [e._replace(start=e.start - start, end=e.end - start)
                  for p in parts for e in p[1]]
        events.sort(key=lambda e: (e.start, e.replica, e.ipu))
        samples = next((v.shape[0] for v in flat if isinstance(v, torch.Tensor) and v.dim() > 0), 0)
        meta = dict(c.schedule.describe())
        meta.update({"schedule": c.schedule.kind, "replicas": self.dp, "samples": samples,
                     "training": c.training, "call": self.call_index,
                     "model": c.options.model_name or ("training" if c.training else "inference"),
                     "stage_ipus": list(c.schedule.stage_ipus),
                     "blocks": [st.blocks for st in c.partition.stages],
                     "processes": self.world, "rank": self.rank,
                     "gathered": self.rank == 0})
        model.__dict__["_timeline"] = Timeline(events, modeled=False, meta=meta)


def _returned_micro_batches(mode, period: int, steps: int) -> List[bool]:
    """Which micro-batches' outputs the output mode returns (only those are gathered)."""
    from ..enums import OutputMode

    if mode == OutputMode.Final:
        return [k == steps - 1 for k in range(steps)]
    if mode == OutputMode.EveryN:
        return [(k + 1) % period == 0 for k in range(steps)]
    return [True] * steps


def _per_ipu_lanes(schedule, ipus: Sequence[int]) -> List[list]:
    """A one-lane (sharded) schedule as one lane per virtual IPU, in the same order."""
    lanes = [[] for _ in ipus]
    where = {ipu: k for k, ipu in enumerate(ipus)}
    for lane in schedule.lanes:
        for a in lane:
            if a.iteration == 0 and a.kind != "S":
                lanes[where[schedule.stage_ipus[a.stage]]].append(a)
    return lanes


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
    """Run one call of ``model`` on processes, or return :data:`NOT_DISTRIBUTED`.

    ``model`` is a PoplarExecutor. Its options decide: several processes
    configured (torchrun's ``WORLD_SIZE``, or ``Options.Distributed.configureProcessId``)
    means this process runs its stages of the model with its peers.
    """
    opts = model.options
    if not is_active(opts):
        return NOT_DISTRIBUTED
    d = model.__dict__
    rt = d.get("_ipukit_distributed")
    flat, spec = pytree.tree_flatten((args, kwargs))
    started = time.time()
    try:
        ensure_process_group(opts)
        if rt is None or not _is_compiled(model):
            if not _is_compiled(model):
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
            d["_ipukit_distributed"] = rt
        return rt.run(model, flat)
    except DistributedError as exc:
        if not getattr(exc, "_peer", False):
            _note_failure(exc)
        raise
    except BaseException as exc:
        if _is_comm_error(exc):
            cause = _peer_failure(started - 1.0)
            if cause is not None and not cause.startswith(f"rank {opts.Distributed.processId}:"):
                who, _, what = cause.partition(": ")
                err = DistributedError(f"ipukit: {who.replace('rank', 'process')} failed "
                                       f"({what}), so process {opts.Distributed.processId} "
                                       "stopped too; see that process's error above.")
                err._peer = True
                raise err from exc
        rank = opts.Distributed.processId
        _note_failure(exc)
        if hasattr(exc, "add_note"):
            exc.add_note(f"(ipukit: raised by process {rank} of {opts.Distributed.numProcesses})")
        raise


def synchronize_weights(model) -> None:
    """Give every process every stage's current weights and buffers (a collective).

    During a run each process updates only its own stages; call this (on every
    process) before saving or evaluating the whole model on one process.
    """
    import torch.distributed as dist

    rt = model.__dict__.get("_ipukit_distributed")
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
