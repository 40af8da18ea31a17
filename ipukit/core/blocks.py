"""Block annotations: PopTorch's ``Block``, ``BeginBlock``, ``BlockFunction``. Outside an
ipukit model they do nothing; while a model is traced a :class:`BlockRecorder` maps each block
to a (stage id, IPU) and inserts ``pipe_split()`` wherever execution moves to another IPU.
"""
from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
from torch.distributed.pipelining import pipe_split

from .errors import BlockError

# the recorder of the trace running in this context (threads record blocks independently)
_recorder: "contextvars.ContextVar[Optional[BlockRecorder]]" = contextvars.ContextVar(
    "ipukit_block_recorder", default=None)


@dataclass
class Segment:
    """A maximal run of the trace on one IPU: one pipeline stage."""

    ipu: int
    blocks: List[str] = field(default_factory=list)
    stage_ids: List[int] = field(default_factory=list)
    recompute: bool = False  # a module in it asked for recomputation
    implicit: bool = False   # the layers that ran before the first block (on IPU 0)


class BlockRecorder:
    """Collects the blocks of one trace and inserts the stage cuts."""

    def __init__(self, assigner, split_stages: bool = False) -> None:
        self.assigner = assigner
        # cut wherever the stage changes, even on one IPU (schedules with several stages per IPU)
        self.split_stages = split_stages
        self.segments: List[Segment] = []
        self.entered: List[str] = []
        self._stack: List[tuple] = []
        self.in_block = False
        self.closed_a_block = False
        self.ops_outside: List[str] = []
        self.model_started = False  # the model's forward has begun (not the tracer's own work)
        self.ops_before = False  # the model's tensor operations ran before its first block
        # operations after the last block stay in it (Lightning's loss), not an error
        self.keep_last_block_open = False

    def begin(self, user_id: Optional[str], ipu_id: Optional[int]) -> str:
        if user_id is None:
            user_id = self.assigner.next_auto_id()
        stage_id, ipu = self.assigner.assign(str(user_id), ipu_id)
        last = self.segments[-1] if self.segments else None
        if last is None and self.ops_before and ipu != 0:
            # PopTorch: "by default layers are allocated onto IPU 0", as pipeline stage 0
            last = Segment(0, stage_ids=[0], implicit=True)
            self.segments.append(last)
        if last is None or last.ipu != ipu or (self.split_stages and stage_id not in last.stage_ids):
            if last is not None:
                pipe_split()
            self.segments.append(Segment(ipu))
        seg = self.segments[-1]
        if user_id not in seg.blocks:
            seg.blocks.append(user_id)
        if stage_id not in seg.stage_ids:
            seg.stage_ids.append(stage_id)
        if user_id not in self.entered:
            self.entered.append(user_id)
        self.in_block = True
        return user_id

    def push(self, user_id: Optional[str], ipu_id: Optional[int]) -> None:
        self._stack.append((self.begin(user_id, ipu_id), ipu_id))

    def pop(self) -> None:
        if self._stack:
            self._stack.pop()
        if self._stack:  # back in the enclosing block
            outer_id, outer_ipu = self._stack[-1]
            self.begin(outer_id, outer_ipu)
        elif self.keep_last_block_open and self.segments:
            self.in_block = True   # what follows the last block runs on its IPU
        else:
            self.in_block = False
            self.closed_a_block = True


def active_recorder() -> Optional[BlockRecorder]:
    """The block recorder of the trace running in this context, or None outside a trace."""
    return _recorder.get()


def note_recompute() -> None:
    """While tracing: the stage being recorded (all of it) recomputes its forward in its backward."""
    recorder = _recorder.get()
    if recorder is not None and recorder.segments:
        recorder.segments[-1].recompute = True


def set_recorder(recorder: Optional[BlockRecorder]) -> Optional[BlockRecorder]:
    """Install ``recorder`` for the duration of a trace (in this context); returns the previous."""
    previous = _recorder.get()
    _recorder.set(recorder)
    return previous


class Block:
    """A context manager naming a part of the model.

    >>> with ipukit.Block("B1", ipu_id=0):
    ...     x = self.layer1(x)

    Blocks with the same ``user_id`` are one block. Stages group blocks
    (see :class:`~ipukit.Stage`); with no explicit stages, a block's
    ``ipu_id`` decides its stage (:class:`~ipukit.AutoStage`).
    """

    def __init__(self, user_id: Optional[str] = None, ipu_id: Optional[int] = None) -> None:
        if ipu_id is not None and (not isinstance(ipu_id, int) or ipu_id < 0):
            raise BlockError(f"Block({user_id!r}, ipu_id={ipu_id!r}): ipu_id must be an int >= 0.")
        self._user_id = user_id
        self._ipu_id = ipu_id

    def __enter__(self) -> "Block":
        if (rec := active_recorder()) is not None:
            rec.push(self._user_id, self._ipu_id)
        return self

    def __exit__(self, *exc) -> None:
        if (rec := active_recorder()) is not None:
            rec.pop()

    @staticmethod
    def start(user_id: Optional[str] = None, ipu_id: Optional[int] = None) -> None:
        """Start a block that lasts until the next block starts (no ``with`` needed)."""
        if (rec := active_recorder()) is not None:
            rec.begin(user_id, ipu_id)

    @staticmethod
    def useAutoId() -> None:
        """Restart automatic block ids ("0", "1", ...) — call at the top of ``forward``."""
        if (rec := active_recorder()) is not None:
            rec.assigner.reset_auto_id()

    def __repr__(self) -> str:
        return f"Block({self._user_id!r}, ipu_id={self._ipu_id!r})"


class _BlockHook:
    """Forward pre-hook that starts a block when a module runs (``BeginBlock``)."""

    def __init__(self, user_id: Optional[str], ipu_id: Optional[int]) -> None:
        self.user_id = user_id
        self.ipu_id = ipu_id

    def __call__(self, module, args) -> None:
        if (rec := active_recorder()) is not None:
            if self.user_id is None:
                self.user_id = rec.assigner.next_auto_id()
            rec.begin(self.user_id, self.ipu_id)

    def __repr__(self) -> str:
        # PopTorch's wording (ids unquoted), which module_repr() shows before the module
        return f"BeginBlock(user_id={self.user_id}, ipu_id={self.ipu_id})"


class _BeginBlockFunction(torch.nn.Module):
    """``BeginBlock`` applied to a plain callable: a parameter-free module that starts the block,
    then calls it (it pickles and deep-copies with the block).
    """

    def __init__(self, fn: Callable, user_id, ipu_id) -> None:
        super().__init__()
        self._layer_to_call = fn
        self._hook = _BlockHook(user_id, ipu_id)

    def forward(self, *args, **kwargs):
        self._hook(self, args)
        return self._layer_to_call(*args, **kwargs)

    # not through Module.__call__: the block starts exactly where the function runs
    __call__ = forward

    def extra_repr(self) -> str:
        name = getattr(self._layer_to_call, "__qualname__", None) or repr(self._layer_to_call)
        return f"{name}, user_id={self._hook.user_id}, ipu_id={self._hook.ipu_id}"


def BeginBlock(layer_to_call, user_id: Optional[str] = None, ipu_id: Optional[int] = None):
    """Start a block whenever ``layer_to_call`` runs: a module (returned, with a forward pre-hook)
    or a plain callable (returned wrapped in a module). The annotation survives
    ``copy.deepcopy`` and ``torch.save``, and :func:`module_repr` shows it."""
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return _BeginBlockFunction(layer_to_call, user_id, ipu_id)
        raise BlockError(
            f"BeginBlock({layer_to_call!r}): expected a torch.nn.Module or a function.")
    if any(isinstance(h, _BlockHook) for h in layer_to_call._forward_pre_hooks.values()):
        raise BlockError(
            f"BeginBlock: {type(layer_to_call).__name__} has already been assigned to a block; "
            "call ipukit.removeBlocks(module) first to re-assign it.")
    layer_to_call.register_forward_pre_hook(_BlockHook(user_id, ipu_id))
    return layer_to_call


def BlockFunction(user_id: Optional[str] = None, ipu_id: Optional[int] = None):
    """Decorator: the decorated function runs inside ``Block(user_id, ipu_id)``."""

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with Block(user_id, ipu_id):
                return func(*args, **kwargs)

        return wrapper

    return decorator


def begin_blocks(module: torch.nn.Module) -> List[Tuple[torch.nn.Module, Optional[str], Optional[int]]]:
    """ipukit: every ``BeginBlock`` annotation in ``module``, as (sub-module, user_id, ipu_id)
    (``user_id`` None until the module first runs inside a recording)."""
    return [(m, h.user_id, h.ipu_id) for m in module.modules()
            for h in m._forward_pre_hooks.values() if isinstance(h, _BlockHook)]


def module_repr(module: torch.nn.Module) -> str:
    """PopTorch's ``module_repr``: ``repr(module)`` with each module's forward pre-hooks before its
    name, e.g. ``(l1): BeginBlock(user_id=None, ipu_id=1) Linear(...)``."""
    if not isinstance(module, torch.nn.Module):
        return repr(module)
    extra = module.extra_repr()
    extra_lines = extra.split("\n") if extra else []
    child_lines = [f"({name}): " + module_repr(child).replace("\n", "\n  ")
                   for name, child in module._modules.items()]
    hooks = "".join(f"{hook!r} " for hook in module._forward_pre_hooks.values())
    text = f"{hooks}{module._get_name()}("
    if len(extra_lines) == 1 and not child_lines:
        text += extra_lines[0]
    elif extra_lines or child_lines:
        text += "\n  " + "\n  ".join(extra_lines + child_lines) + "\n"
    return text + ")"


def removeBlocks(module: torch.nn.Module) -> torch.nn.Module:
    """Remove every ``BeginBlock`` annotation from ``module`` and its sub-modules."""
    if not isinstance(module, torch.nn.Module):
        raise BlockError(f"removeBlocks({module!r}): expected a torch.nn.Module.")
    for m in module.modules():
        for key in [k for k, h in m._forward_pre_hooks.items() if isinstance(h, _BlockHook)]:
            del m._forward_pre_hooks[key]
    return module
