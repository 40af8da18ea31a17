"""How much memory each pipeline stage needs, and why the schedule matters.

An IPU holds its stage's weights, gradient accumulators, optimiser state (unless
``TensorLocations`` keeps it in host memory) and the activations of every micro-batch
whose backward has not run yet. :func:`memory_report` counts the first three from the
model's tensors, measures one micro-batch's activations per stage and multiplies them by
the micro-batches the schedule keeps in flight (:func:`activation_stash`).

:func:`measured_memory` puts a call's *measured* peak per virtual IPU (``Timeline.memory``)
beside that model and a per-IPU refinement (:func:`ipu_stash_peak`, :func:`recompute_bytes`).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..core.errors import ModelStateError
from ..schedules.ir import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Schedule
from ..schedules.registry import KINDS


# -- micro-batches in flight ---------------------------------------------------------------

def activation_stash(kind: str, num_stages: int, micro_batches: int) -> List[int]:
    """Peak number of micro-batches whose activations each stage holds.

    GPipe: all M; 1F1B: N − s on stage s; sharded: 1; inference: 0; other kinds
    read off the built schedule (:func:`stash_of`).
    """
    kind = kind.lower()
    if kind not in KINDS:
        raise ValueError(f"schedule kind {kind!r}: use one of {list(KINDS)}")
    N, M = int(num_stages), int(micro_batches)
    if N < 1 or M < 1:
        raise ValueError("num_stages and micro_batches must be >= 1")
    if "inference" in kind:
        return [0] * N
    if kind == "gpipe":
        return [M] * N
    if kind == "1f1b":
        return [min(N - s, M) for s in range(N)]
    if kind.startswith("sharded"):
        return [1] * N
    from ..schedules.build import build

    return stash_of(build(kind, N, M))


def stash_of(schedule: Schedule) -> List[int]:
    """Peak micro-batches held per stage: forwards whose backward (or ``W``) has not run yet."""
    held = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    if not schedule.training:
        return peak
    for lane in schedule.lanes:
        for a in lane:
            if a.kind == FORWARD:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind in (BACKWARD, WEIGHT_GRAD):
                held[a.stage] -= 1
    return peak


# -- the report ----------------------------------------------------------------------------

@dataclass
class MemoryReport:
    """Bytes per pipeline stage (per replica); ``stages`` is a list of dicts.

    Per stage: ``parameter_bytes``, ``gradient_accumulator_bytes``, ``optimizer_state_bytes``
    (``optimizer_state_source``: ``"state"`` counted or ``"formula"``), split into
    ``optimizer_state_on_chip_bytes`` / ``optimizer_state_host_bytes``,
    ``activation_bytes_per_micro_batch``, ``micro_batches_in_flight``,
    ``activation_stash_bytes`` and ``total_on_chip_bytes``.
    """

    stages: List[Dict[str, Any]]
    schedule_kind: str
    num_stages: int
    micro_batches: int
    training: bool
    optimizer: Optional[str] = None
    optimizer_on_chip: bool = True
    replicas: int = 1
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def total(self, key: str = "total_on_chip_bytes") -> int:
        return sum(st[key] for st in self.stages)

    def per_ipu(self, key: str = "total_on_chip_bytes") -> Dict[int, int]:
        """``key`` summed over the stages of each virtual IPU."""
        out: Dict[int, int] = {}
        for st in self.stages:
            out[st["ipu"]] = out.get(st["ipu"], 0) + st[key]
        return out

    def figure(self):
        from .plots import memory_figure

        return memory_figure(self)

    def __repr__(self) -> str:
        mib = [f"{st['total_on_chip_bytes'] / 2 ** 20:.2f}" for st in self.stages]
        return (f"MemoryReport({self.schedule_kind}, {self.micro_batches} micro-batches, "
                f"on chip per stage (MiB): {mib})")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _unique(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return list({id(p): p for p in params}.values())


def _state_multiple(optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> Optional[float]:
    """Optimiser state per parameter, in parameter sizes, for optimisers with no state yet."""
    o = torch.optim
    if isinstance(optimizer, o.SGD):
        return 1.0 if group.get("momentum", 0) else 0.0
    if isinstance(optimizer, (o.Adam, o.AdamW)):
        return 3.0 if group.get("amsgrad") else 2.0
    if isinstance(optimizer, o.RMSprop):
        return 1.0 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    if isinstance(optimizer, o.Adagrad):
        return 1.0
    if isinstance(optimizer, (o.Adadelta, o.Adamax, o.NAdam, o.RAdam)):
        return 2.0
    return None


def optimizer_state_bytes(optimizer, params: Sequence[torch.nn.Parameter]) -> Tuple[int, str]:
    """Bytes of optimiser state for ``params``: counted when it exists, else by formula."""
    if optimizer is None or not params:
        return 0, "none"
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    total, source = 0, "state"
    for p in params:
        state = optimizer.state.get(p)
        if state:
            total += tensor_bytes(v for v in state.values() if torch.is_tensor(v))
            continue
        group = group_of.get(id(p))
        if group is None:
            continue
        multiple = _state_multiple(optimizer, group)
        if multiple is None:
            source = "unknown"
            continue
        total += int(multiple * p.numel() * p.element_size())
        source = "formula" if source == "state" else source
    return total, source


# -- activations ---------------------------------------------------------------------------

_ACTIVATIONS: Dict[int, Tuple[Any, List[int]]] = {}


def _storage_key(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(t), t.numel() * t.element_size()


def _sample_inputs(model) -> List[torch.Tensor]:
    return [(torch.randn if e[2].is_floating_point or e[2].is_complex else torch.zeros)(
        e[1], dtype=e[2]) for e in model.program.signature if e[0] == "tensor"]


@contextmanager
def unchanged_state(modules: Iterable[torch.nn.Module], weights: bool = False):
    """Run a measurement that leaves buffers (and ``weights``) and every RNG as they were."""
    modules = list(modules)
    tensors = [b for m in modules for b in m.buffers()]
    if weights:
        tensors += [p for m in modules for p in m.parameters()]
    saved = [(t, t.detach().clone()) for t in _unique(tensors)]
    cuda = sorted({t.device.index or 0 for t, _ in saved if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():
                for live, copy in saved:
                    live.copy_(copy)


def _stage_args(plan, stage, flat, outputs) -> list:
    """A stage's arguments, as the executor builds them (received activations detached)."""
    device = plan.device_of(stage.index)
    args = []
    for ref in stage.args:
        v = ref.value
        if ref.kind == "input":
            v = flat[ref.index].to(device)
        elif ref.kind == "stage":
            v = outputs[ref.index][0 if ref.item is None else ref.item]
            if isinstance(v, torch.Tensor):
                v = v.detach().to(device).requires_grad_(v.requires_grad)
        args.append(v)
    return args


def _held_bytes(stage, args) -> Tuple[int, tuple]:
    """Run one stage; bytes of its stashed inputs/outputs and autograd's saved tensors."""
    own = {_storage_key(t)[0] for t in (*stage.module.parameters(), *stage.module.buffers())}
    held: Dict[Any, int] = {}

    def keep(t):
        if isinstance(t, torch.Tensor):
            ptr, nbytes = _storage_key(t)
            if ptr not in own:
                held[ptr] = max(held.get(ptr, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = stage.module(*map(keep, args))
    outs = out if stage.tuple_output else (out,)
    for v in outs:
        keep(v)
    return sum(held.values()), outs


def activation_bytes(model) -> List[int]:
    """Bytes one micro-batch leaves alive on each stage until its backward runs.

    Runs one synthetic micro-batch through the stages as the executor does and counts,
    without duplicates, what autograd saves plus the stashed inputs and outputs (not
    parameters or buffers); state is left as it was. Cached per compiled model; an
    inference model keeps nothing.
    """
    plan = model.program
    if not plan.training:
        return [0] * plan.partition.num_stages
    cached = _ACTIVATIONS.get(id(plan))
    if cached is not None and cached[0]() is plan:
        return list(cached[1])
    from ..core.ops import running_on_ipu

    stages = plan.partition.stages
    outputs: Dict[int, tuple] = {}
    result = []
    with unchanged_state(st.module for st in stages), torch.enable_grad(), running_on_ipu():
        flat = _sample_inputs(model)
        for st in stages:
            held, outputs[st.index] = _held_bytes(st, _stage_args(plan, st, flat, outputs))
            result.append(held)
    _ACTIVATIONS[id(plan)] = (weakref.ref(plan), result)
    weakref.finalize(plan, _ACTIVATIONS.pop, id(plan), None)
    return list(result)


def stage_tensor_bytes(model, inputs: Optional[Sequence[torch.Tensor]] = None) -> List[Dict[str, Any]]:
    """Per stage, what one micro-batch's forward really keeps, measured: bytes by kind.

    Runs one micro-batch (``inputs``, default synthetic) as the executor does (a recomputing
    stage under ``torch.utils.checkpoint``) and counts, without duplicates: ``saved_bytes``,
    ``input_bytes`` / ``output_bytes``, ``held_bytes`` (all of them) and ``sent_bytes`` (handed
    to other IPUs). Parameters and buffers are not counted; state is left as it was.
    """
    from torch.utils.checkpoint import checkpoint

    from ..core.ops import running_on_ipu

    plan = model.program
    stages = plan.partition.stages
    outputs: Dict[int, tuple] = {}
    result = []
    with unchanged_state(st.module for st in stages), torch.enable_grad(), running_on_ipu():
        # own copies: a slice of a larger batch would count its whole storage
        flat = ([t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
                if inputs is not None else _sample_inputs(model))
        for st in stages:
            own = {_storage_key(t)[0] for t in (*st.module.parameters(), *st.module.buffers())}
            kept: Dict[str, Dict[Any, int]] = {"saved": {}, "input": {}, "output": {}}

            def note(where, t):
                if isinstance(t, torch.Tensor):
                    ptr, nbytes = _storage_key(t)
                    if ptr not in own:
                        kept[where][ptr] = max(kept[where].get(ptr, 0), nbytes)
                return t

            args = [note("input", v) for v in _stage_args(plan, st, flat, outputs)]
            with torch.autograd.graph.saved_tensors_hooks(lambda t: note("saved", t),
                                                          lambda t: t):
                out = (checkpoint(st.module, *args, use_reentrant=False)
                       if st.recompute and plan.training else st.module(*args))
            outs = outputs[st.index] = out if st.tuple_output else (out,)
            for v in outs:
                note("output", v)
            sent = sum(_storage_key(outs[item])[1] for consumer, _, item in plan.consumers[st.index]
                       if isinstance(outs[item], torch.Tensor)
                       and stages[consumer].ipu != st.ipu)
            union = {**kept["saved"], **kept["input"], **kept["output"]}
            result.append({"stage": st.index, "ipu": st.ipu, "blocks": list(st.blocks),
                           "recompute": bool(st.recompute),
                           "saved_bytes": sum(kept["saved"].values()),
                           "input_bytes": sum(kept["input"].values()),
                           "output_bytes": sum(kept["output"].values()),
                           "held_bytes": sum(union.values()), "sent_bytes": sent})
    return result


# -- the report ----------------------------------------------------------------------------

def memory_report(model, schedule_kind: Optional[str] = None,
                  micro_batches: Optional[int] = None) -> MemoryReport:
    """Memory per stage of a compiled ipukit model, for its schedule or another one.

    ``schedule_kind`` / ``micro_batches`` default to the model's own; give others to see
    what e.g. GPipe with 32 micro-batches would need for the same stages.
    """
    plan = getattr(model, "program", None)
    if plan is None:
        raise ModelStateError("memory_report() needs a compiled ipukit model: call it once (or "
                              "model.compile(*inputs)) first.")
    schedule: Schedule = plan.schedule
    options = model.options
    part = plan.partition
    N = part.num_stages
    kind = (schedule_kind or schedule.kind).lower()
    M = int(micro_batches or schedule.micro_batches)
    if plan.training and "inference" in kind:
        raise ValueError(f"schedule_kind {kind!r} is an inference schedule; this is a training "
                         "model (use 'gpipe', '1f1b' or 'sharded')")
    if not plan.training and "inference" not in kind:
        kind = "sharded-inference" if kind.startswith("sharded") else "inference"
    in_flight = (stash_of(schedule) if kind == schedule.kind and M == schedule.micro_batches
                 else activation_stash(kind, N, M))
    per_mb = activation_bytes(model)
    optimizer = model.optimizer if plan.training else None
    on_chip = options.TensorLocations.on_chip("optimizer")
    stages = []
    for st in part.stages:
        params = _unique(st.parameters)
        trainable = [p for p in params if p.requires_grad] if plan.training else []
        opt_bytes, source = optimizer_state_bytes(optimizer, trainable)
        entry = {
            "stage": st.index, "ipu": st.ipu, "blocks": list(st.blocks),
            "parameters": sum(p.numel() for p in params),
            "parameter_bytes": tensor_bytes(params),
            "gradient_accumulator_bytes": tensor_bytes(trainable),
            "optimizer_state_bytes": opt_bytes,
            "optimizer_state_source": source,
            "optimizer_on_chip": on_chip,
            "optimizer_state_on_chip_bytes": opt_bytes if on_chip else 0,
            "optimizer_state_host_bytes": 0 if on_chip else opt_bytes,
            "activation_bytes_per_micro_batch": per_mb[st.index],
            "micro_batches_in_flight": in_flight[st.index],
            "activation_stash_bytes": per_mb[st.index] * in_flight[st.index],
        }
        entry["total_on_chip_bytes"] = sum(entry[k] for k in (
            "parameter_bytes", "gradient_accumulator_bytes", "optimizer_state_on_chip_bytes",
            "activation_stash_bytes"))
        stages.append(entry)
    notes = []
    if any(st["optimizer_state_source"] == "formula" for st in stages):
        notes.append("optimiser state estimated from the optimiser type (no state yet)")
    if any(st["optimizer_state_source"] == "unknown" for st in stages):
        notes.append(f"optimiser state of {type(optimizer).__name__} is not known before "
                     "its first step: counted as 0")
    return MemoryReport(stages=stages, schedule_kind=kind, num_stages=N, micro_batches=M,
                        training=plan.training,
                        optimizer=type(optimizer).__name__ if optimizer is not None else None,
                        optimizer_on_chip=on_chip, replicas=options.replication_factor,
                        notes=notes)


# -- measured beside modeled ---------------------------------------------------------------

@dataclass
class MeasuredMemory:
    """A call's measured peak per virtual IPU beside the modeled report (replica 0).

    Per IPU (``rows``): ``measured_peak_bytes``, ``measured_baseline_bytes`` (at the start),
    ``measured_end_bytes``, ``measured_above_baseline_bytes``, ``measured_held_bytes`` (the
    most alive as a pass starts); ``modeled_bytes`` (:func:`memory_report`'s total),
    ``modeled_static_bytes``, ``modeled_stash_bytes``, ``modeled_ipu_bytes`` (static plus
    :func:`ipu_stash_peak` with :func:`recompute_bytes`), ``modeled_held_bytes`` (the same
    without a backward's rebuilt activations), ``ratio`` (measured ÷ modeled) and
    ``allocator_peak_bytes`` (GPU only).
    """

    rows: List[Dict[str, Any]]
    schedule_kind: str
    micro_batches: int
    modeled: Optional[MemoryReport] = None
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {"rows": [dict(r) for r in self.rows], "schedule_kind": self.schedule_kind,
                "micro_batches": self.micro_batches, "notes": list(self.notes)}

    def ratios(self) -> Dict[int, float]:
        """Measured ÷ modeled peak per virtual IPU."""
        return {r["ipu"]: r["ratio"] for r in self.rows}

    def __repr__(self) -> str:
        cells = ", ".join(f"IPU {r['ipu']}: {r['measured_peak_bytes'] / 2 ** 20:.3f} measured / "
                          f"{r['modeled_bytes'] / 2 ** 20:.3f} modeled MiB ({r['ratio']:.2f})"
                          for r in self.rows)
        return f"MeasuredMemory({self.schedule_kind}, {self.micro_batches} micro-batches: {cells})"


def ipu_stash_peak(schedule: Schedule, per_micro_batch: Sequence[int],
                   rebuilt: Optional[Sequence[int]] = None) -> Dict[int, int]:
    """Peak activation bytes per virtual IPU, its stages' stashes added up *at the same time*.

    Walks each IPU's lane: a forward adds ``per_micro_batch[s]``, ``B`` frees it, a split
    backward's ``I`` adds ``rebuilt[s]`` (a recomputing stage's rebuilt graph, kept for ``W``)
    and ``W`` frees both.
    """
    rebuilt = list(rebuilt) if rebuilt is not None else [0] * schedule.num_stages
    peaks: Dict[int, int] = {}
    if not schedule.training:
        return {ipu: 0 for ipu in set(schedule.stage_ipus)}
    for lane in schedule.lanes:
        level = top = 0
        for a in lane:
            if a.kind == FORWARD:
                level += per_micro_batch[a.stage]
            elif a.kind == INPUT_GRAD:
                level += rebuilt[a.stage]
            elif a.kind == BACKWARD:
                level -= per_micro_batch[a.stage]
            elif a.kind == WEIGHT_GRAD:
                level -= per_micro_batch[a.stage] + rebuilt[a.stage]
            top = max(top, level)
        for ipu in {schedule.stage_ipus[a.stage] for a in lane}:
            peaks[ipu] = max(peaks.get(ipu, 0), top)
    return peaks


def recompute_bytes(model) -> List[Tuple[int, int]]:
    """Per stage of a training model: (bytes one micro-batch keeps until its backward, bytes
    its backward rebuilds on top), recomputation counted.

    A recomputing stage (:func:`ipukit.recomputation_checkpoint`): (inputs + outputs,
    :func:`activation_bytes` − that); other stages: (:func:`activation_bytes`, 0).
    """
    full = activation_bytes(model)
    plan = model.program
    if not plan.training or not any(st.recompute for st in plan.partition.stages):
        return [(b, 0) for b in full]
    kept = stage_tensor_bytes(model)
    return [(st["held_bytes"], max(0, full[st["stage"]] - st["held_bytes"])) if st["recompute"]
            else (full[st["stage"]], 0) for st in kept]


def _level_at(samples, t: float) -> int:
    import bisect

    i = bisect.bisect_right(samples, (t, float("inf")))
    return samples[i - 1][1] if i else (samples[0][1] if samples else 0)


def measured_memory(model, timeline=None) -> MeasuredMemory:
    """The measured peak per virtual IPU of a call (``timeline``, default the model's last)
    beside :func:`memory_report`'s modeled bytes for the same schedule.

    The call must have run inside ``ipukit.runtime.memory_track.track_memory()``
    (or with ``IPUKIT_TRACK_MEMORY=1``).
    """
    timeline = model.getTimeline() if timeline is None else timeline
    tracks = [m for m in getattr(timeline, "memory", []) if m.replica == 0]
    if not tracks:
        raise ModelStateError("this call's timeline has no measured memory: run the call inside "
                              "ipukit.runtime.memory_track.track_memory() (or with "
                              "IPUKIT_TRACK_MEMORY=1), then ask again.")
    report = memory_report(model)
    modeled = report.per_ipu()
    stash = report.per_ipu("activation_stash_bytes")
    static = {ipu: b - stash[ipu] for ipu, b in modeled.items()}
    plan = model.program
    same = (report.schedule_kind == plan.schedule.kind
            and report.micro_batches == plan.schedule.micro_batches)
    kept = recompute_bytes(model)
    together = (ipu_stash_peak(plan.schedule, [k for k, _ in kept], [r for _, r in kept])
                if same else dict(stash))
    rebuilt: Dict[int, int] = {}
    if not plan.schedule.split_backward:   # split: I's rebuilt graph is in the walk above
        for st in report.stages:
            rebuilt[st["ipu"]] = max(rebuilt.get(st["ipu"], 0), kept[st["stage"]][1])
    everything = sum(modeled.values())
    rows = []
    for m in sorted(tracks, key=lambda m: m.ipu):
        model_bytes = modeled.get(m.ipu, everything if m.ipu < 0 else 0)
        starts = [e.start for e in timeline.device_events()
                  if e.replica == 0 and (e.ipu == m.ipu or m.ipu < 0) and e.kind != "step"]
        rows.append({
            "ipu": m.ipu, "measured_peak_bytes": m.peak, "measured_baseline_bytes": m.baseline,
            "measured_end_bytes": m.end, "measured_above_baseline_bytes": m.peak - m.baseline,
            "measured_held_bytes": max((_level_at(m.samples, t) for t in starts), default=m.peak),
            "measured_parts": dict(m.parts),
            "modeled_bytes": model_bytes,
            "modeled_static_bytes": static.get(m.ipu, sum(static.values()) if m.ipu < 0 else 0),
            "modeled_stash_bytes": stash.get(m.ipu, sum(stash.values()) if m.ipu < 0 else 0),
            "modeled_ipu_bytes": (static.get(m.ipu, 0) + together.get(m.ipu, 0)
                                  + rebuilt.get(m.ipu, 0)) if m.ipu >= 0 else model_bytes,
            "modeled_held_bytes": (static.get(m.ipu, 0) + together.get(m.ipu, 0)) if m.ipu >= 0
            else model_bytes,
            "ratio": m.peak / model_bytes if model_bytes else float("inf"),
            "allocator_peak_bytes": m.allocator_peak})
    notes = list(report.notes)
    if any(getattr(st, "recompute", False) for st in model.program.partition.stages):
        notes.append("recomputed stages: memory_report's stash counts every saved tensor of a "
                     "micro-batch, the measured one only what recomputation keeps (plus one "
                     "micro-batch's activations while its backward recomputes them); "
                     "modeled_ipu_bytes counts recomputation")
    return MeasuredMemory(rows, report.schedule_kind, report.micro_batches, report, notes)
