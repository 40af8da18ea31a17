"""PopTorch's in-model operations: on CPU/GPU they compute the same values with ordinary
PyTorch (most are identities), checking their arguments as PopTorch did; :func:`identity_loss`
marks the loss that backpropagation starts from.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable, List, Optional

import torch

from .._torch import pytree

from .enums import MatMulSerializationMode, MultiConvPlanType, OverlapMode
from .errors import Error, OperationError, UnsupportedError

_marks = threading.local()


class LossMarks:
    """Remembers tensors passed through :func:`identity_loss` while active."""

    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []

    def __enter__(self) -> "LossMarks":
        self._previous = getattr(_marks, "current", None)
        _marks.current = self
        return self

    def __exit__(self, *exc) -> None:
        _marks.current = self._previous


def identity_loss(x: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Mark ``x`` as the loss that backpropagation starts from, reduced by ``"sum"``, ``"mean"``
    or ``"none"``. Without one, the loss is the model's output named ``loss``, else its last."""
    if reduction == "sum":
        out = x.sum()
    elif reduction == "mean":
        out = x.mean()
    elif reduction == "none":
        out = x * 1 if x.requires_grad else x
    else:
        raise Error(f"identity_loss(..., reduction={reduction!r}): use 'sum', 'mean' or 'none'.")
    current: Optional[LossMarks] = getattr(_marks, "current", None)
    if current is not None:
        current.tensors.append(out)
    return out


_running = threading.local()


def isRunningOnIpu() -> bool:
    """True while the model runs inside an ipukit model (on a virtual IPU)."""
    return getattr(_running, "value", False)


class running_on_ipu:
    """Context manager that makes :func:`isRunningOnIpu` return True; ``training`` says whether
    the step belongs to a training model (``None``: keep the enclosing context's).
    """

    def __init__(self, training: Optional[bool] = None) -> None:
        self._training = training

    def __enter__(self):
        self._previous = (getattr(_running, "value", False), getattr(_running, "training", None))
        _running.value = True
        if self._training is not None:
            _running.training = self._training

    def __exit__(self, *exc):
        _running.value, _running.training = self._previous


def _in_training_step() -> bool:
    """Whether the step running now is a training one (as the trace says, else from autograd)."""
    training = getattr(_running, "training", None)
    if training is not None:
        return training
    return isRunningOnIpu() and torch.is_grad_enabled() and not _tracing()


def _inference_only(op: str, instead: str) -> None:
    if _in_training_step():
        raise UnsupportedError(
            f"poptorch.{op}() is only supported in inference. ipukit refuses it in a "
            f"training model, as PopTorch did: {instead}, or run the model with "
            "ipukit.inferenceModel.")


def ipu_print_tensor(tensor: torch.Tensor, title: str = "", *args, **kwargs) -> torch.Tensor:
    """Prints ``title: tensor`` to standard error each time it runs (not in a traced, multi-stage
    model), and returns ``tensor``."""
    if not _tracing():
        print(f"{title}: {tensor}" if title else str(tensor), file=sys.stderr, flush=True)
    return tensor


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """Identity."""
    return tensor


def recomputationCheckpoint(*tensors):
    """Identity (recomputation is an IPU memory technique)."""
    return tensors[0] if len(tensors) == 1 else tensors


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float) -> torch.Tensor:
    """Identity (an IPU tile-memory hint)."""
    return tensor


def _tensor_arg(op: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise OperationError(f"ipukit.{op}: {name} must be a torch.Tensor, "
                             f"not {type(value).__name__}.")
    return value


def _int_arg(op: str, name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise OperationError(f"ipukit.{op}: {name}={value!r} must be a Python int >= "
                             f"{minimum} (a constant of the traced step, not a tensor).")
    return value


def _tensor_list(op: str, name: str, values) -> List[torch.Tensor]:
    if not isinstance(values, list):
        raise OperationError(f"ipukit.{op}: {name} must be a list of tensors, "
                             f"not {type(values).__name__}.")
    for i, value in enumerate(values):
        _tensor_arg(op, f"{name}[{i}]", value)
    return values


def _as_list(result) -> List[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else list(result)


def _tracing() -> bool:
    """True while torch.export traces a model (to split it into stages)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode,
                     factor: int = 0, keep_precision: bool = False) -> torch.Tensor:
    """``torch.matmul(lhs, rhs)`` (PopTorch computed it as ``factor`` smaller products to save
    IPU memory); ``factor`` must divide the dimension ``mode`` names, as in PopTorch."""
    if not isinstance(mode, MatMulSerializationMode):
        raise OperationError(f"ipukit.serializedMatMul: mode={mode!r} must be a "
                             "MatMulSerializationMode (e.g. MatMulSerializationMode.ReducingDim).")
    _int_arg("serializedMatMul", "factor", factor)
    if not isinstance(keep_precision, bool):
        raise OperationError(f"ipukit.serializedMatMul: keep_precision={keep_precision!r} "
                             "must be True or False.")
    dims = {MatMulSerializationMode.InputChannels: ("lhs", lhs.shape[-2]),
            MatMulSerializationMode.ReducingDim: ("lhs", lhs.shape[-1]),
            MatMulSerializationMode.OutputChannels: ("rhs", rhs.shape[-1])}
    if mode in dims and factor > 1 and dims[mode][1] % factor:
        side, size = dims[mode]
        raise OperationError(
            f"ipukit.serializedMatMul: factor={factor} does not divide the {mode.name} "
            f"dimension ({size}, of {side}); use a factor of {size}.")
    return torch.matmul(lhs, rhs)


def _overlap(op: str, tensors, mode):
    if not isinstance(mode, OverlapMode):
        raise OperationError(f"ipukit.{op}: mode={mode!r} must be an OverlapMode "
                             "(e.g. OverlapMode.OverlapAccumulationLoop).")
    for leaf in pytree.tree_leaves(tensors):
        _tensor_arg(op, "every element", leaf)
    return tensors


def set_overlap_for_input(input_tensors, mode: OverlapMode):
    """Returns ``input_tensors`` (PopTorch overlapped their host transfer with compute)."""
    return _overlap("set_overlap_for_input", input_tensors, mode)


def set_overlap_for_output(output_tensors, mode: OverlapMode):
    """Returns ``output_tensors`` (PopTorch overlapped their host transfer with compute)."""
    return _overlap("set_overlap_for_output", output_tensors, mode)


def for_loop(count: int, body: Callable, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Runs ``body`` ``count`` times, each iteration's outputs the next one's inputs (a Python
    loop, unrolled when traced); as in PopTorch, a training model refuses it."""
    if not isinstance(inputs, list):
        raise OperationError(
            "poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
            f"(Object is not list) ipukit got a {type(inputs).__name__}: pass the loop's "
            "initial values as a list, e.g. [x].")
    for i, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise OperationError(
                "poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
                f"(Object contained in list at index {i} is not torch.tensor) ipukit got a "
                f"{type(value).__name__}: make it a tensor (torch.tensor(value)) or use it "
                "inside the body directly.")
    _int_arg("for_loop", "count", count)
    _inference_only("for_loop", "unroll the loop with a Python loop in forward() "
                                "(for _ in range(count): ...), which ipukit traces and trains")
    values = [t.clone() for t in inputs]
    for _ in range(count):
        outputs = _as_list(body(*values))
        if len(outputs) != len(values):
            raise OperationError(
                f"ipukit.for_loop: body returned {len(outputs)} tensor(s) for {len(values)} "
                "input(s); it must return one tensor per input (each iteration's outputs "
                "are the next iteration's inputs).")
        values = outputs
    return values


def cond(condition: torch.Tensor, then_body: Callable, then_inps: List[torch.Tensor],
         else_body: Callable, else_inps: List[torch.Tensor]) -> List[torch.Tensor]:
    """``then_body(*then_inps)`` if ``condition`` else ``else_body(*else_inps)``, as a list.
    Traced, both branches run and ``torch.where`` picks each output (same values and gradients);
    as in PopTorch, a training model refuses it."""
    for name, value in (("then_inps", then_inps), ("else_inps", else_inps)):
        if not isinstance(value, list):
            raise OperationError(
                "poptorch.cond expects then_inps and else_inps tensors to be a list of "
                f"tensors. (Object is not list) ipukit got a {type(value).__name__} for "
                f"{name}: pass each branch's inputs as a list, e.g. [x] (or [] for none).")
    _tensor_list("cond", "then_inps", then_inps)
    _tensor_list("cond", "else_inps", else_inps)
    _inference_only("cond", "compute both branches and pick with torch.where(condition, a, b), "
                            "which ipukit traces and trains")
    if not (isinstance(condition, torch.Tensor) and _tracing()):
        return _as_list(then_body(*then_inps) if condition else else_body(*else_inps))
    then_out, else_out = _as_list(then_body(*then_inps)), _as_list(else_body(*else_inps))
    if len(then_out) != len(else_out):
        raise OperationError(f"ipukit.cond: then_body returned {len(then_out)} tensor(s), "
                             f"else_body {len(else_out)}; both must return the same number.")
    flag = condition.reshape(()).bool()
    return [torch.where(flag, a, b) for a, b in zip(then_out, else_out)]


def _positions(op: str, tensor: torch.Tensor, start, size: int, step: int = 1) -> torch.Tensor:
    _tensor_arg(op, "start", start)
    if start.numel() != 1:
        raise OperationError(f"ipukit.{op}: start must hold one index, not {start.numel()}.")
    return start.reshape(()).long() + torch.arange(0, size, step, device=tensor.device)


def _check_in_range(op: str, index: torch.Tensor, length: int) -> None:
    """Eagerly, a slice past the end is an error naming it (traced, the position is data)."""
    if _tracing():
        return
    first, last = int(index[0]), int(index[-1])
    if first < 0 or last >= length:
        raise OperationError(f"ipukit.{op}: the slice [{first}..{last}] falls outside the "
                             f"dimension of size {length}; keep start within 0..{length - 1} "
                             "and start + size within the dimension.")


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int,
                  step: int) -> torch.Tensor:
    """``tensor[start:start + size:step]`` along ``dim``, with ``start`` a tensor (data, so one
    traced step serves every start)."""
    _tensor_arg("dynamic_slice", "tensor", tensor)
    _tensor_arg("dynamic_slice", "start", start)
    _int_arg("dynamic_slice", "dim", dim)
    _int_arg("dynamic_slice", "size", size, minimum=1)
    _int_arg("dynamic_slice", "step", step, minimum=1)
    length = tensor.shape[dim]
    if length % size:  # PopTorch's rule for dynamic slices
        raise OperationError(f"ipukit.dynamic_slice: the size of the slice ({size}) must be a "
                             f"factor of the slicing dimension ({length}).")
    index = _positions("dynamic_slice", tensor, start, size, step)
    _check_in_range("dynamic_slice", index, length)
    return tensor.index_select(dim, index)


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,
                   size: int) -> torch.Tensor:
    """A copy of ``input`` with ``input[start:start + size]`` along ``dim`` replaced by ``src``."""
    op = "dynamic_update"
    _tensor_arg(op, "input", input)
    _tensor_arg(op, "src", src)
    _int_arg(op, "dim", dim)
    _int_arg(op, "size", size, minimum=1)
    if input.dim() != src.dim() or input.dtype != src.dtype:
        raise OperationError(
            f"ipukit.dynamic_update: input ({input.dim()}-d, {input.dtype}) and src "
            f"({src.dim()}-d, {src.dtype}) must have the same number of dimensions and dtype.")
    if src.shape[dim] != size:
        raise OperationError(f"ipukit.dynamic_update: src has {src.shape[dim]} element(s) "
                             f"along dim {dim} but size={size}; they must match.")
    index = _positions(op, input, start, size)
    _check_in_range(op, index, input.shape[dim])
    return input.index_copy(dim, index, src)


class CPU:
    """Runs ``layer_to_call`` on the host in the middle of a model: ipukit's virtual IPUs run on
    the host already, so the layer is simply called (its parameters frozen, as in PopTorch).
    """

    def __init__(self, layer_to_call: Callable, ID: str):
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._layer_to_call = layer_to_call
        self._ID = ID

    def __call__(self, *args, **kwargs):
        return self._layer_to_call(*args, **kwargs)


class _Scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class MultiConv(_Scope):
    """Context manager grouping convolutions (an IPU planning hint; no effect). Its setters check
    and chain as PopTorch's; a value is one setting for all convolutions or a list, one each."""

    def __init__(self) -> None:
        self.settings: dict = {}

    def _set(self, name: str, value, valid: Callable, expected: str) -> "MultiConv":
        if value is None:  # back to the default
            self.settings.pop(name, None)
            return self
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(valid(v) for v in values):
            raise OperationError(f"ipukit.MultiConv.{name}({value!r}): expected {expected}.")
        self.settings[name] = value
        return self

    def availableMemoryProportions(self, value) -> "MultiConv":
        return self._set("availableMemoryProportions", value,
                         lambda v: isinstance(v, (int, float)) and 0.0 <= v <= 1.0,
                         "proportions between 0.0 and 1.0")

    def partialsTypes(self, value) -> "MultiConv":
        return self._set("partialsTypes", value, lambda v: v in (torch.float16, torch.float32, "half", "float"),
                         "torch.float16 or torch.float32")

    def enableConvDithering(self, value) -> "MultiConv":
        return self._set("enableConvDithering", value, lambda v: isinstance(v, bool), "True or False")

    def planType(self, value: MultiConvPlanType) -> "MultiConv":
        return self._set("planType", value, lambda v: isinstance(v, MultiConvPlanType),
                         "a MultiConvPlanType")

    def perConvReservedTiles(self, value: int) -> "MultiConv":
        return self._set("perConvReservedTiles", value,
                         lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                         "an int >= 0")

    def cycleBackOff(self, value: float) -> "MultiConv":
        return self._set("cycleBackOff", value,
                         lambda v: isinstance(v, (int, float)) and 0.0 <= v <= 1.0,
                         "a number between 0.0 and 1.0")


class NameScope(_Scope):
    """Context manager naming the operations inside it (for IPU profiles; no effect)."""

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise OperationError(f"ipukit.NameScope({name!r}): the name must be a string.")
        self.name = name


def custom_op(inputs, name: str, domain: str, domain_version: int, example_outputs,
              attributes=None):
    """PopTorch's hook for Poplar/PopART custom operations: not available off the IPU."""
    raise UnsupportedError(
        f"ipukit.custom_op({name!r}, domain {domain!r}): custom operations are Poplar "
        "(IPU) programs and cannot run without the IPU SDK. Write the operation in "
        "PyTorch instead (for a custom gradient: a torch.autograd.Function).")


def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0,
                            beam_width: int = 100, top_paths: int = 1):
    """PopTorch's IPU CTC beam-search decoder: not available off the IPU."""
    raise UnsupportedError(
        "ipukit.ctc_beam_search_decoder: the IPU's CTC decoder is a Poplar operation "
        "ipukit does not provide. Decode on the host instead (e.g. torchaudio's "
        "ctc_decoder) from the probabilities the model returns.")
