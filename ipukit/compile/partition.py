"""Model → stage modules that share parameters with the user's module.

The model is traced once per input signature with ``torch.distributed.pipelining.pipeline()``;
the block recorder inserts ``pipe_split()`` wherever execution moves to another IPU. The
stage modules hold the user's own ``Parameter`` objects, so an optimiser built on the user's
model updates them and an inference model of the module sees every step. A model whose trace
has one stage runs eagerly, uncut, so models that cannot be traced still work.
"""
from __future__ import annotations

import contextlib
import operator
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode
from .._torch import pytree

from ..core import blocks as _blocks
from .flat import flat_stage
from ..core.enums import AutoStage
from ..core.errors import (BlockError, Error, InputShapeError, ModelStateError,
                           PipelineConfigError, TracingError)
from ..core.ops import LossMarks, running_on_ipu
from ..core.strategies import PipelinedExecution, ShardedExecution


@dataclass(frozen=True)
class Ref:
    """Where a stage argument or model output comes from: ``"input"`` (flat model input ``index``),
    ``"stage"`` (output ``item`` of stage ``index``; None: its only tensor) or ``"const"``.
    """

    kind: str
    index: int = 0
    item: Optional[int] = None
    value: Any = None


@dataclass
class StageModule:
    """One pipeline stage: a module, where its arguments come from, its IPU."""

    index: int
    ipu: int
    blocks: List[str]
    module: torch.nn.Module
    args: List[Ref]
    tuple_output: bool
    parameters: List[torch.nn.Parameter] = field(default_factory=list)
    recompute: bool = False  # keep only the inputs; rerun the forward in the backward


@dataclass
class Partition:
    """A model cut into stages, plus how to rebuild its outputs."""

    stages: List[StageModule]
    outputs: List[Ref]               # one per flat output leaf
    out_spec: Any                    # pytree spec of the model's output
    loss_output: Optional[int]       # index into ``outputs`` of the loss
    traced: bool
    loss_marked: bool = False        # the loss went through identity_loss (any shape allowed)
    mutated_inputs: frozenset = frozenset()  # tensor inputs the model changes in place

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def ipus(self) -> List[int]:
        return sorted({s.ipu for s in self.stages})

    def consumers(self, stage: int) -> List[Tuple[int, int, Optional[int]]]:
        """(consumer stage, argument position, item) for every use of ``stage``'s outputs."""
        return [(s.index, pos, ref.item) for s in self.stages for pos, ref in enumerate(s.args)
                if ref.kind == "stage" and ref.index == stage]


_SEEN: dict = {}
_KEYS = itertools.count()


class _FlatModel(torch.nn.Module):
    """Calls the user's model with flat tensor inputs; returns flat tensor outputs."""

    def __init__(self, model: torch.nn.Module, in_spec, template: Sequence) -> None:
        super().__init__()
        # an int key, not id(self): torch.export may run a copy of this module, which keeps it
        self._key = next(_KEYS)
        weakref.finalize(self, _SEEN.pop, self._key, None)
        self.model = model
        self._in_spec = in_spec
        self._template = list(template)   # non-tensor leaves stay fixed
        self._tensor_slots = [i for i, v in enumerate(template) if isinstance(v, torch.Tensor)]
        # fast paths: positional tensors in, a tensor or flat tuple out (no pytree work)
        n = len(self._template)
        self._positional = (len(self._tensor_slots) == n
                            and pytree.tree_flatten((tuple(range(n)), {}))[1] == in_spec)
        self._flat_out: Optional[int] = None   # set by use_fast_outputs()
        self._record = True
        self.mixed_precision = False

    def use_fast_outputs(self) -> None:
        """After the output structure is known: skip recording it on every call."""
        self._record = False
        leaves, spec = self.out_leaves, self.out_spec
        if leaves is None or not all(isinstance(v, torch.Tensor) for v in leaves):
            return
        n = len(leaves)
        if n == 1 and spec == pytree.tree_flatten(leaves[0])[1]:
            self._flat_out = 0
        elif spec == pytree.tree_flatten(tuple(leaves))[1]:
            self._flat_out = n

    # torch.export restores module state mutated while tracing: the outputs are kept outside
    @property
    def out_spec(self):
        return _SEEN.get(self._key, {}).get("spec")

    @property
    def out_leaves(self) -> Optional[list]:
        return _SEEN.get(self._key, {}).get("leaves")

    def forward(self, *tensors):
        if self.mixed_precision:
            with MixedPrecision(self.model, fixed_weights=True):
                return self._forward(*tensors)
        return self._forward(*tensors)

    def _forward(self, *tensors):
        recorder = _blocks.active_recorder()
        if recorder is not None:
            recorder.model_started = True
        if self._positional:
            out = self.model(*tensors)
        else:
            leaves = list(self._template)
            for slot, t in zip(self._tensor_slots, tensors):
                leaves[slot] = t
            args, kwargs = pytree.tree_unflatten(leaves, self._in_spec)
            out = self.model(*args, **kwargs)
        fast = self._flat_out
        if fast == 0 and isinstance(out, torch.Tensor):
            return (out,)
        if fast and type(out) is tuple and len(out) == fast:
            return out
        flat, spec = pytree.tree_flatten(out)
        if self._record:
            _SEEN[self._key] = {"spec": spec, "leaves": flat}
        return tuple(v for v in flat if isinstance(v, torch.Tensor))


class _OutsideBlockWatch(TorchFunctionMode):
    """Notes tensor ops that run outside any block: before the first (they run on IPU 0)
    or after a Block closed (refused when the model has several stages)."""

    def __init__(self, recorder: _blocks.BlockRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        rec = self.recorder
        if rec.model_started and not rec.segments and isinstance(result, torch.Tensor):
            rec.ops_before = True
        if rec.closed_a_block and not rec.in_block and isinstance(result, torch.Tensor):
            rec.ops_outside.append(getattr(func, "__name__", str(func)))
        return result


# Operations whose tensor operands must share one dtype in PyTorch ("mat1 and mat2 must
# have the same dtype", "expected scalar type Half but found Float"), by torch function name.
_SAME_DTYPE_OPS = frozenset({
    "linear", "bilinear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm",
    "addbmm", "baddbmm", "addmv", "mv", "dot", "vdot", "inner", "tensordot", "einsum",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "prelu"})
# Normalisations: PyTorch runs a float16 input with float32 weight, bias and statistics.
_NORM_OPS = frozenset({"batch_norm", "instance_norm", "layer_norm", "group_norm"})
_REDUCED = (torch.float16, torch.bfloat16)


class MixedPrecision(TorchFunctionMode):
    """PopTorch's resolution of float16 activations meeting float32 weights (the model's own
    parameters and buffers): matrix products and convolutions use the weights cast to the
    activations' dtype (gradients still reach the float32 weights; integer activations are cast
    to the weights' dtype); normalisations use float16 weights as float32 when the running
    statistics are float32; everything else follows PyTorch's type promotion. A traced model
    gets the casts in its stage graphs; a model run eagerly runs under this mode."""

    def __init__(self, model: torch.nn.Module, fixed_weights: bool = False) -> None:
        super().__init__()
        self.model = model
        self.casts = 0     # operations that needed the rule
        self._fixed = fixed_weights
        self._ids = None   # (parameter ids, buffer ids)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name in _SAME_DTYPE_OPS or name in _NORM_OPS:
            args, kwargs = self._resolve(name in _NORM_OPS, args, kwargs)
        return func(*args, **kwargs)

    def _state_ids(self):  # read per op unless fixed: torch.export swaps in stand-ins
        if self._ids is None or not self._fixed:
            self._ids = ({id(p) for p in self.model.parameters()},
                         {id(b) for b in self.model.buffers()})
        return self._ids

    def _resolve(self, norm: bool, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if len({t.dtype for t in tensors}) < 2:
            return args, kwargs
        params, buffers = self._state_ids()
        weights = [t for t in tensors if id(t) in params or id(t) in buffers]
        acts = [t for t in tensors if id(t) not in params and id(t) not in buffers]
        if not weights or not acts:
            return args, kwargs
        act_float = {t.dtype for t in acts if t.is_floating_point()}
        weight_float = {t.dtype for t in weights if t.is_floating_point()}
        cast = {}
        if norm:
            stats = {t.dtype for t in weights if id(t) in buffers and t.is_floating_point()}
            if len(act_float) == 1 and act_float <= set(_REDUCED) and len(stats) == 1:
                target = stats.pop()
                cast = {id(t): target for t in weights
                        if id(t) in params and t.is_floating_point() and t.dtype != target}
        elif len(act_float) == 1 and act_float <= set(_REDUCED):
            target = next(iter(act_float))
            cast = {id(t): target for t in weights if t.dtype == torch.float32}
        elif not act_float and len(weight_float) == 1:
            target = next(iter(weight_float))   # integer activations, float weights
            cast = {id(t): target for t in acts}
        if not cast:
            return args, kwargs
        self.casts += 1
        leaves = [t.to(cast[id(t)]) if isinstance(t, torch.Tensor) and id(t) in cast else t
                  for t in leaves]
        return pytree.tree_unflatten(leaves, spec)


def _root_cause(exc: BaseException) -> str:
    seen = set()
    while id(exc) not in seen and (exc.__cause__ or exc.__context__) is not None:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _own_error(exc: BaseException) -> Optional[BaseException]:
    """The ipukit error that the tracer wrapped in its own, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, Error) and not isinstance(exc, TracingError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _loss_index(flat_model: _FlatModel, marks: LossMarks) -> Tuple[Optional[int], bool]:
    """(tensor position of the loss, whether identity_loss marked it): the identity_loss output,
    else an output named ``loss``, else the last tensor output.
    """
    leaves = flat_model.out_leaves
    tensor_leaves = [v for v in leaves if isinstance(v, torch.Tensor)]
    for marked in reversed(marks.tensors):
        for i, leaf in enumerate(tensor_leaves):
            if leaf is marked:
                return i, True
    if flat_model.out_spec is not None:
        try:
            paths = pytree.tree_flatten_with_path(
                pytree.tree_unflatten(list(leaves), flat_model.out_spec))[0]
        except Exception:  # noqa: BLE001 - an output pytree cannot rebuild: no named loss
            paths = []
        names = [getattr(p[-1], "key", getattr(p[-1], "name", None)) if p else None
                 for p, leaf in paths if isinstance(leaf, torch.Tensor)]
        if "loss" in names:
            return names.index("loss"), False
    return (len(tensor_leaves) - 1 if tensor_leaves else None), False


def _validate(recorder: _blocks.BlockRecorder, strategy: PipelinedExecution,
              begins: List[Tuple[str, int]]) -> None:
    entered = set(recorder.entered)
    for stage in strategy.stages:
        missing = [b for b in stage.blocks if b not in entered]
        if missing:
            raise BlockError(
                f"{stage!r} names block(s) {missing} that the model never entered while "
                f"it was traced (blocks entered: {recorder.entered}). Check the block "
                "names in your Stages, or whether that code path runs for these inputs.")
    if len(recorder.segments) > 1 and recorder.ops_outside:
        ops = ", ".join(sorted(set(recorder.ops_outside))[:6])
        raise BlockError(
            f"Tensor operations ({ops}) ran after a Block closed and outside any block, so "
            "ipukit cannot tell which stage they belong to. Put them inside a "
            "`with ipukit.Block(...)` scope, or use ipukit.Block.start(...) / "
            "ipukit.BeginBlock(...), which stay open until the next block begins.")
    if recorder.segments and recorder.segments[0].implicit:
        begins = [("(the layers before the first block)", 0)] + list(begins)
    if not isinstance(strategy, ShardedExecution):
        _check_contiguous_stages(strategy, begins)
        highest = -1
        for block, stage_id in begins:
            if stage_id < highest:
                raise BlockError(
                    f"Block {block!r} has stage id {stage_id}, but a block with stage id "
                    f"{highest} ran before it. In a PipelinedExecution, stage ids must not "
                    "decrease along the model. Use AutoStage.AutoIncrement, reorder the "
                    "Stages, or use ShardedExecution.")
            highest = max(highest, stage_id)


def _check_contiguous_stages(strategy: PipelinedExecution,
                             begins: List[Tuple[str, int]]) -> None:
    """PopART's rule for a pipeline: its stage ids are 0 .. n-1, none missing (with
    ``AutoStage.SameAsIpu`` a block's stage id is its ``ipu_id``). One IPU is not a pipeline.
    """
    if strategy.auto_stage != AutoStage.SameAsIpu:
        return
    stage_ids = sorted({stage_id for _, stage_id in begins})
    if len(stage_ids) < 2:
        return
    missing = [i for i in range(len(stage_ids)) if i not in stage_ids]
    if missing:
        on = {}
        for block, stage_id in begins:
            on.setdefault(stage_id, {})[block] = None
        used = ", ".join(f"IPU {i}: {list(on[i])}" for i in stage_ids)
        raise PipelineConfigError(
            f"The set of pipeline stages for all Ops contains {len(stage_ids)} stages, but "
            f"stage {missing[0]} is missing. With AutoStage.SameAsIpu a block's ipu_id is "
            f"its pipeline stage, and the blocks run on {used}: no block runs on IPU "
            f"{missing[0]}. Number the ipu_ids 0 to {len(stage_ids) - 1} without gaps, "
            "or choose the stages yourself: PipelinedExecution(AutoStage.AutoIncrement), "
            "PipelinedExecution(Stage(...).ipu(n), ...), or ShardedExecution.")


def _check_not_meta(model: torch.nn.Module, flat_inputs: Sequence) -> None:
    """Refuse meta tensors (a shape, no data), weights first: the trace sample follows them."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ModelStateError(
                    f"The {kind} {name!r} of {type(model).__name__} is on the meta device "
                    "(a shape without data), so the model cannot run. Give the model real "
                    "weights before wrapping it: model.to_empty(device='cpu') and then "
                    "model.load_state_dict(weights) (or build the model outside "
                    "torch.device('meta')).")
    for i, v in enumerate(flat_inputs):
        if isinstance(v, torch.Tensor) and v.is_meta:
            raise InputShapeError(
                f"Input {i} of {type(model).__name__} (shape {tuple(v.shape)}) is on the "
                "meta device (a shape without data): pass real tensors, e.g. "
                "torch.zeros(shape), or tensor.to_empty(device='cpu') filled with data.")


_TRACE_LOCK = threading.RLock()


def trace(model: torch.nn.Module, flat_inputs: Sequence, in_spec,
          strategy: PipelinedExecution, split_stages: bool = False,
          training: Optional[bool] = None) -> Partition:
    """Trace ``model`` on one micro-batch and cut it into stages.

    ``split_stages`` cuts wherever the stage changes, even on the same IPU. ``training`` says
    whether the model is a training one (``for_loop`` and ``cond`` then refuse it; ``None``: not
    said). Float16 activations meeting float32 weights follow :class:`MixedPrecision`; tensors
    on the meta device are refused first. Traces run one at a time (torch.export's tracing state
    is process-wide).
    """
    _check_not_meta(model, flat_inputs)
    with _TRACE_LOCK:
        return _trace(model, flat_inputs, in_spec, strategy, split_stages, training)


def _trace(model: torch.nn.Module, flat_inputs: Sequence, in_spec,
           strategy: PipelinedExecution, split_stages: bool = False,
           training: Optional[bool] = None) -> Partition:
    from torch.distributed.pipelining import pipeline

    flat_model = _FlatModel(model, in_spec, flat_inputs)
    tensors = tuple(v for v in flat_inputs if isinstance(v, torch.Tensor))
    recorder = _blocks.BlockRecorder(strategy.stage_manager(), split_stages)
    begins: List[Tuple[str, int]] = []
    original_begin = recorder.begin

    def begin(user_id, ipu_id):
        resolved = original_begin(user_id, ipu_id)
        begins.append((resolved, recorder.assigner.assign(resolved, ipu_id)[0]))
        return resolved

    recorder.begin = begin
    previous = _blocks.set_recorder(recorder)
    marks = LossMarks()
    mixed = MixedPrecision(model)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        with marks, mixed, _OutsideBlockWatch(recorder), warnings.catch_warnings(), \
                running_on_ipu(training=training):
            warnings.simplefilter("ignore")
            pipe = pipeline(flat_model, mb_args=tensors)
    except (BlockError, PipelineConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the reason
        ours = _own_error(exc)
        if ours is not None:  # an ipukit error raised inside the trace: report it as is
            raise ours.with_traceback(None) from None
        raise TracingError(
            f"ipukit could not trace {type(model).__name__} to split it into stages at its "
            f"Block boundaries: {_root_cause(exc)}\nAs in PopTorch, a model step "
            "is traced once and replayed: data-dependent Python control flow, "
            ".item()/.tolist()/print of tensor values, and in-place changes to module "
            "attributes cannot be captured. Remove them from forward(), or run the model "
            "as a single stage (no Blocks).") from exc
    finally:
        _blocks.set_recorder(previous)
        with torch.no_grad():  # tracing must not leave a trace in BatchNorm statistics
            for name, buf in model.named_buffers():
                if name in buffers and buf.shape == buffers[name].shape:
                    buf.copy_(buffers[name])

    _validate(recorder, strategy, begins)
    loss, marked = _loss_index(flat_model, marks)
    out_leaves = flat_model.out_leaves
    if len(recorder.segments) <= 1:
        part = eager(model, flat_inputs, in_spec, out_spec=flat_model.out_spec,
                     out_leaves=out_leaves, loss=loss, loss_marked=marked,
                     ipu=recorder.segments[0].ipu if recorder.segments else 0,
                     blocks=recorder.segments[0].blocks if recorder.segments else [],
                     mixed_precision=mixed.casts > 0)
        part.mutated_inputs = _mutated_inputs(pipe.split_gm)
        return part
    if pipe.num_stages != len(recorder.segments):
        raise TracingError(
            f"The trace has {pipe.num_stages} pieces but the blocks define "
            f"{len(recorder.segments)} stages; this usually means a Block boundary falls "
            "inside a function the tracer inlines differently. Move the Block boundaries "
            "to module boundaries.")
    part = _from_split_graph(pipe, recorder, flat_model, out_leaves, loss)
    part.loss_marked = marked
    part.mutated_inputs = _mutated_inputs(pipe.split_gm)
    return part


def _mutated_inputs(split_gm: torch.nn.Module) -> frozenset:
    """Indices of the tensor inputs an in-place op in the trace writes to (the executor gives
    them their own copy)."""
    found = set()
    for module in split_gm.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            schema = getattr(node.target, "_schema", None)
            if node.op != "call_function" or schema is None or not schema.is_mutable or not node.args:
                continue
            first = node.args[0]
            name = getattr(first, "target", "")
            if getattr(first, "op", None) == "placeholder" and str(name).startswith("tensors_"):
                found.add(int(str(name).rsplit("_", 1)[1]))
    return frozenset(found)


def _fast(module: torch.nn.Module) -> torch.nn.Module:
    """Run unflattened sub-modules through their generated code, not fx.Interpreter node by node."""
    from torch.export.unflatten import InterpreterModule

    for m in module.modules():
        if isinstance(m, InterpreterModule) and hasattr(m, "_run_with_interpreter"):
            m._run_with_interpreter = False
    return module


def _from_split_graph(pipe, recorder, flat_model, out_leaves, loss) -> Partition:
    graph = pipe.split_gm.graph
    value_of = {}
    n_inputs = 0
    stage_nodes = {}
    stages: List[StageModule] = []

    def ref_of(arg) -> Ref:
        if isinstance(arg, torch.fx.Node):
            return value_of[arg]
        return Ref("const", value=arg)

    for node in graph.nodes:
        if node.op == "placeholder":
            value_of[node] = Ref("input", n_inputs)
            n_inputs += 1
        elif node.op == "call_module":
            k = len(stages)
            module = flat_stage(_fast(pipe.get_stage_module(k)))
            args = [ref_of(a) for a in node.args]
            if node.kwargs:
                raise TracingError("ipukit: unexpected keyword arguments between stages")
            seg = recorder.segments[k]
            stages.append(StageModule(index=k, ipu=seg.ipu, blocks=list(seg.blocks),
                                      module=module, args=args, tuple_output=False,
                                      parameters=list(module.parameters()),
                                      recompute=seg.recompute))
            stage_nodes[node] = k
            value_of[node] = Ref("stage", k, None)
        elif node.op == "call_function" and node.target is operator.getitem:
            src = value_of[node.args[0]]
            stages[src.index].tuple_output = True
            value_of[node] = Ref("stage", src.index, node.args[1])
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            outputs = [ref_of(o) for o in outs]
    it = iter(outputs)
    all_outputs = [next(it) if isinstance(leaf, torch.Tensor) else Ref("const", value=leaf)
                   for leaf in out_leaves]
    loss_leaf = _tensor_position_to_leaf(out_leaves, loss)
    return Partition(stages=stages, outputs=all_outputs, out_spec=flat_model.out_spec,
                     loss_output=loss_leaf, traced=True)


def _tensor_position_to_leaf(out_leaves, tensor_index: Optional[int]) -> Optional[int]:
    slots = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
    return None if tensor_index is None or tensor_index >= len(slots) else slots[tensor_index]


def eager(model: torch.nn.Module, flat_inputs: Sequence, in_spec, out_spec=None,
          out_leaves=None, loss: Optional[int] = None, ipu: int = 0,
          blocks: Optional[List[str]] = None, loss_marked: bool = False,
          mixed_precision: bool = False) -> Partition:
    """A one-stage partition that runs the user's model eagerly (no trace), under
    :class:`MixedPrecision` when ``mixed_precision``."""
    flat_model = _FlatModel(model, in_spec, flat_inputs)
    flat_model.mixed_precision = mixed_precision
    n_tensors = sum(isinstance(v, torch.Tensor) for v in flat_inputs)
    stage = StageModule(index=0, ipu=ipu, blocks=list(blocks or []), module=flat_model,
                        args=[Ref("input", i) for i in range(n_tensors)], tuple_output=True,
                        parameters=list(model.parameters()))
    part = Partition(stages=[stage], outputs=[], out_spec=out_spec, loss_output=None,
                     traced=False, loss_marked=loss_marked)
    if out_leaves is not None:
        _SEEN[flat_model._key] = {"spec": out_spec, "leaves": list(out_leaves)}
        _set_eager_outputs(part, out_leaves, loss)
        flat_model.use_fast_outputs()
    return part


def _set_eager_outputs(part: Partition, out_leaves, loss_tensor_index: Optional[int]) -> None:
    k = itertools.count()
    part.outputs = [Ref("stage", 0, next(k)) if isinstance(leaf, torch.Tensor)
                    else Ref("const", value=leaf) for leaf in out_leaves]
    part.loss_output = _tensor_position_to_leaf(out_leaves, loss_tensor_index)


def discover_eager_outputs(part: Partition, flat_inputs: Sequence) -> None:
    """Run an untraced one-stage model once without gradients to learn its output structure."""
    flat_model = part.stages[0].module
    marks = LossMarks()
    mixed = MixedPrecision(flat_model.model)
    state = {n: b.detach().clone() for n, b in flat_model.named_buffers()}
    rng = torch.get_rng_state()
    try:
        with marks, mixed, torch.no_grad(), running_on_ipu():
            flat_model(*[v for v in flat_inputs if isinstance(v, torch.Tensor)])
        flat_model.mixed_precision = flat_model.mixed_precision or mixed.casts > 0
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for n, b in flat_model.named_buffers():
                b.copy_(state[n])
    part.out_spec = flat_model.out_spec
    loss, part.loss_marked = _loss_index(flat_model, marks)
    _set_eager_outputs(part, flat_model.out_leaves, loss)
    flat_model.use_fast_outputs()


@contextlib.contextmanager
def recording_blocks(strategy: PipelinedExecution):
    """Record blocks during an eager call (to detect Blocks in an untraceable model)."""
    recorder = _blocks.BlockRecorder(strategy.stage_manager())

    def begin(user_id, ipu_id):  # no pipe_split outside a trace
        if user_id is None:
            user_id = recorder.assigner.next_auto_id()
        _, ipu = recorder.assigner.assign(str(user_id), ipu_id)
        if not recorder.segments or recorder.segments[-1].ipu != ipu:
            recorder.segments.append(_blocks.Segment(ipu))
        recorder.in_block = True
        return user_id

    recorder.begin = begin
    previous = _blocks.set_recorder(recorder)
    try:
        yield recorder
    finally:
        _blocks.set_recorder(previous)
