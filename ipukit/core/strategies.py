"""Execution strategies: how blocks are grouped into stages and placed on IPUs, PopTorch's way
(a :class:`Stage` groups blocks and may pin them to an IPU; without stages
:class:`~ipukit.AutoStage` gives each block its stage id). Blocks apply them while tracing.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .enums import AutoStage
from .errors import BlockError, OptionsError


class Stage:
    """One or more blocks that run on one IPU.

    >>> Stage("B1", "B2").ipu(0)
    """

    def __init__(self, *block_ids: str) -> None:
        for b in block_ids:
            if not isinstance(b, str):
                raise OptionsError(
                    f"Stage({', '.join(map(repr, block_ids))}): block ids must be "
                    f"strings, got {b!r} ({type(b).__name__}). Name blocks with "
                    "Block('name') and list those names here.")
        self._blocks: Tuple[str, ...] = tuple(block_ids)
        self._ipu: Optional[int] = None
        self._stage_id: int = -1

    @property
    def blocks(self) -> List[str]:
        """The ids of the blocks in this stage."""
        return list(self._blocks)

    def ipu(self, ipu: int) -> "Stage":
        """Place this stage on virtual IPU ``ipu``."""
        if not isinstance(ipu, int) or isinstance(ipu, bool) or ipu < 0:
            raise OptionsError(f"Stage{self._blocks}.ipu({ipu!r}): the IPU must be an int >= 0.")
        self._ipu = ipu
        return self

    def _to_dict(self) -> dict:
        return {"blocks": list(self._blocks), "ipu": self._ipu, "stage_id": self._stage_id}

    def __repr__(self) -> str:
        ipu = f".ipu({self._ipu})" if self._ipu is not None else ""
        return f"Stage({', '.join(map(repr, self._blocks))}){ipu}"


class PipelinedExecution:
    """Run stages on their IPUs as a pipeline: micro-batches overlap in time.

    Accepts an :class:`~ipukit.AutoStage` value, or stages given as
    :class:`Stage` objects, block ids, or lists of block ids (one stage each).
    """

    _kind = "pipelined"

    def __init__(self, *args) -> None:
        self._auto_stage = AutoStage.SameAsIpu
        self._stages: List[Stage] = []
        self._block_map: Dict[str, Stage] = {}
        if len(args) == 1 and isinstance(args[0], AutoStage):
            self._auto_stage = args[0]
            return
        for stage_id, arg in enumerate(args):
            stage = (arg if isinstance(arg, Stage) else Stage(arg) if isinstance(arg, str)
                     else Stage(*arg) if isinstance(arg, (list, tuple)) else None)
            if stage is None:
                raise OptionsError(
                    f"{type(self).__name__}: argument {stage_id} is {arg!r}; pass Stage "
                    "objects, block ids (str), lists of block ids, or one AutoStage value.")
            stage._stage_id = stage_id
            for block in stage.blocks:
                if block in self._block_map:
                    raise OptionsError(
                        f"{type(self).__name__}: block {block!r} is listed in more than one "
                        "Stage. Each block belongs to exactly one stage.")
                self._block_map[block] = stage
            self._stages.append(stage)

    @property
    def stages(self) -> List[Stage]:
        return list(self._stages)

    @property
    def auto_stage(self) -> Optional[AutoStage]:
        """How blocks get their stage ids when no Stages are listed (None when they are)."""
        return None if self._stages else self._auto_stage

    def stage(self, block_id: str) -> Stage:
        """The explicit stage a block belongs to."""
        if block_id not in self._block_map:
            raise BlockError(f"Unknown block {block_id!r}; known blocks: {list(self._block_map)}")
        return self._block_map[block_id]

    def stage_manager(self) -> "StageAssigner":
        """A fresh assigner of blocks to (stage id, IPU) for one trace (PopTorch's stage manager)."""
        return StageAssigner(self)

    def _to_dict(self) -> dict:
        d = {"type": type(self).__name__}
        if self._stages:
            d["stages"] = [s._to_dict() for s in self._stages]
        else:
            d["auto_stage"] = self._auto_stage.name
        return d

    def __repr__(self) -> str:
        inner = ", ".join(map(repr, self._stages)) if self._stages else f"AutoStage.{self._auto_stage.name}"
        return f"{type(self).__name__}({inner})"


class ShardedExecution(PipelinedExecution):
    """Run the stages one micro-batch at a time: only one IPU is busy at once."""

    _kind = "sharded"


class _PhasedExecution:
    def __init__(self, *args, **kwargs) -> None:
        raise OptionsError(
            f"{type(self).__name__} is not supported by ipukit: phased execution "
            "swaps weights between IPU and streaming memory, which has no CPU/GPU "
            "equivalent here. Use PipelinedExecution or ShardedExecution.")


class SerialPhasedExecution(_PhasedExecution):
    """Not supported (raises a clear error)."""


class ParallelPhasedExecution(_PhasedExecution):
    """Not supported (raises a clear error)."""


class PhasedExecution(_PhasedExecution):
    """Not supported (raises a clear error); PopTorch's older name for phased execution."""


class Phase(_PhasedExecution):
    """Not supported (raises a clear error): a phase of phased execution."""


class StageAssigner:
    """Maps each block entered during one trace to (stage id, ipu), PopTorch's way."""

    def __init__(self, strategy: PipelinedExecution) -> None:
        self.strategy = strategy
        self._next_auto_id = 0
        self._next_stage_id = 1
        self._auto_map: Dict[str, int] = {}

    def next_auto_id(self) -> str:
        value = str(self._next_auto_id)
        self._next_auto_id += 1
        return value

    def reset_auto_id(self) -> None:
        self._next_auto_id = 0

    def assign(self, user_id: str, ipu_id: Optional[int]) -> Tuple[int, int]:
        """Return ``(stage_id, ipu)`` for a block."""
        strategy = self.strategy
        if strategy._block_map:
            if user_id not in strategy._block_map:
                raise BlockError(
                    f"The model entered Block {user_id!r}, but the execution strategy "
                    f"{strategy!r} lists no Stage for it. Add {user_id!r} to a Stage, "
                    f"or rename the block to one of {list(strategy._block_map)}.")
            stage = strategy._block_map[user_id]
            ipu = stage._ipu if stage._ipu is not None else ipu_id
            return stage._stage_id, stage._stage_id if ipu is None else ipu
        if user_id not in self._auto_map:
            if strategy._auto_stage == AutoStage.SameAsIpu:
                if ipu_id is None:
                    raise BlockError(
                        f"Block {user_id!r} has no ipu_id, and the execution strategy "
                        f"{strategy!r} places blocks by their ipu_id (AutoStage.SameAsIpu). "
                        "Give the block an ipu_id (Block(..., ipu_id=N)) or list the "
                        "blocks in Stages: options.setExecutionStrategy("
                        "ipukit.PipelinedExecution(ipukit.Stage('B1').ipu(0), ...)).")
                self._auto_map[user_id] = ipu_id
            else:
                self._auto_map[user_id] = self._next_stage_id
                self._next_stage_id += 1
        stage_id = self._auto_map[user_id]
        return stage_id, stage_id if ipu_id is None else ipu_id
