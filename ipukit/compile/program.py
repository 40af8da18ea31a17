"""The compiled state of a model: one frozen :class:`Program` (stages, routing, devices,
schedule, batching, input signature, in-place inputs, the tensors its stages hold), read by
runtimes, reports and widgets through public fields; ``replica_modules`` and
``runtime_cache`` are the caches it fills.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import torch

from ..core.enums import OutputMode, ReductionType
from ..core.errors import LossError
from ..core.batching import Batching, kept_rows
from .partition import Partition
from ..schedules.ir import Schedule


@dataclass(frozen=True)
class Program:
    """What compiling a model produced (frozen)."""

    partition: Partition
    schedule: Schedule
    training: bool
    devices: Dict[int, torch.device]           # virtual IPU -> torch device
    batching: Batching
    output_mode: OutputMode
    output_period: int
    input_names: Tuple[str, ...]
    in_spec: Any                               # pytree spec of (args, kwargs)
    signature: Tuple[Any, ...]                 # per flat input: ("tensor", micro shape, dtype) | ("value", repr)
    shapes: Tuple[Any, ...]                    # per flat input: (full shape, dtype) | None
    tensor_inputs: Tuple[int, ...]             # flat positions of the tensor inputs
    reduction: ReductionType = ReductionType.Mean
    threads_per_worker: Optional[int] = None
    offload_optimizer: bool = False
    record: bool = True
    track_memory: bool = False                 # Options.trackMemory: measure memory per IPU
    compile_seconds: float = 0.0
    # flat position of each input the model changes in place -> where the wrapper's copies go
    mutated_inputs: Dict[int, torch.device] = field(default_factory=dict)
    # (("Parameter" | "Buffer", name), tensor) as compiled: the tensors the stages hold
    module_tensors: Tuple[Tuple[Tuple[str, str], torch.Tensor], ...] = ()
    # derived in __post_init__
    consumers: List[List[Tuple[int, int, int]]] = field(init=False)
    host_outputs: List[List[Tuple[int, int]]] = field(init=False)
    trainable: List[List[torch.nn.Parameter]] = field(init=False)
    loss_stage: Optional[int] = field(init=False)
    loss_item: int = field(init=False)
    keep_rows: Optional[FrozenSet[int]] = field(init=False)
    # (stage, replica >= 1) -> that replica's copy of a stage module with buffers
    replica_modules: Dict[Tuple[int, int], torch.nn.Module] = field(init=False)
    # what a runtime derives from the program alone at the first call, keyed by its user
    runtime_cache: Dict[Any, Any] = field(init=False)

    def __post_init__(self) -> None:
        part, n = self.partition, self.partition.num_stages
        host: List[List[Tuple[int, int]]] = [[] for _ in range(n)]
        for j, ref in enumerate(part.outputs):
            if ref.kind == "stage":
                host[ref.index].append((j, 0 if ref.item is None else ref.item))
        derived: Dict[str, Any] = dict(
            replica_modules={}, runtime_cache={}, loss_stage=None, loss_item=0, host_outputs=host,
            consumers=[[(c, pos, 0 if item is None else item) for c, pos, item in part.consumers(s)]
                       for s in range(n)],
            trainable=[[p for p in st.parameters if p.requires_grad] for st in part.stages])
        if part.loss_output is not None and self.training:
            ref = part.outputs[part.loss_output]
            if ref.kind == "stage":
                derived["loss_stage"] = ref.index
                derived["loss_item"] = 0 if ref.item is None else ref.item
        derived["keep_rows"] = kept_rows(self.output_mode, self.output_period, self.batching)
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def stage_ipus(self) -> List[int]:
        return [st.ipu for st in self.partition.stages]

    def device_of(self, stage: int) -> torch.device:
        return self.devices.get(self.partition.stages[stage].ipu, torch.device("cpu"))

    def module_for(self, stage: int, replica: int) -> torch.nn.Module:
        """The module replica ``replica`` runs for ``stage`` (see :meth:`prepare_replicas`)."""
        mine = self.replica_modules.get((stage, replica))
        return self.partition.stages[stage].module if mine is None else mine

    def prepare_replicas(self, replicas: int, broadcast: bool = True) -> None:
        """Give replicas 1.. their own buffers (weights are shared; replica 0 runs the user's
        modules), copied once, then refreshed from the host before each call when ``broadcast``
        (PopTorch's ``broadcastBuffers``)."""
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
                if broadcast:
                    with torch.no_grad():
                        for theirs, own in zip(original.buffers(), mine.buffers()):
                            own.copy_(theirs)
                for theirs, own in zip(original.modules(), mine.modules()):
                    own.training = theirs.training

    def loss_of(self, outs) -> Optional[torch.Tensor]:
        """The loss the loss stage's backward starts from (None when it needs no gradient)."""
        loss = outs[self.loss_item]
        if not loss.requires_grad:
            return None
        if loss.dim() > 0 and not self.partition.loss_marked:
            raise LossError(
                f"The loss (the model's output used as loss, shape {list(loss.shape)}) is not "
                "a scalar, so there is no single number to minimise. Reduce it (e.g. "
                "loss.mean()), or mark the loss with ipukit.identity_loss(loss, reduction="
                "'mean'|'sum'|'none'); a training model must return its loss (PopTorch's rule: "
                "'return output, loss').")
        return loss

    def same_inputs(self, flat: List[Any], spec) -> bool:
        """Every call's cheap check: same structure, shapes and dtypes as compiled."""
        if len(flat) != len(self.shapes) or spec != self.in_spec:
            return False
        for v, expected, sig in zip(flat, self.shapes, self.signature):
            if expected is None:
                if isinstance(v, torch.Tensor) or repr(v) != sig[1]:
                    return False
            elif not isinstance(v, torch.Tensor) or v.shape != expected[0] \
                    or v.dtype != expected[1] or v.is_meta:
                return False
        return True


def signature_of(flat: List[Any], factor: int) -> Tuple[Any, ...]:
    """Per flat input: a tensor's micro-batch shape and dtype, or a value's repr."""
    return tuple(("tensor", (v.shape[0] // factor, *v.shape[1:]) if v.dim() else (), v.dtype)
                 if isinstance(v, torch.Tensor) else ("value", repr(v)) for v in flat)
