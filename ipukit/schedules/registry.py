"""The one registry of schedule kinds, each one record: the names ``Options.pipelineSchedule``
takes, the placement, whether the backward is split, torch's class, and the generator.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple


class Kind(NamedTuple):
    """One schedule kind."""

    name: str                   #: ipukit's kind ("1f1b")
    title: str                  #: ``Options.pipelineSchedule``'s name: torch's class less "Schedule"
    placement: str              #: "line" (stage s on IPU s), "loop" (s mod P) or "v" (a V)
    split_backward: bool        #: backward as I (input grads) then W (weight grads)
    torch_class: Optional[str]  #: torch.distributed.pipelining.schedules' class, if one exists
    generator: Optional[str]    #: the function of :mod:`.generators` writing its lanes


#: The pipelined training schedules.
PIPELINED: Tuple[Kind, ...] = (
    Kind("gpipe", "GPipe", "line", False, "ScheduleGPipe", None),
    Kind("1f1b", "1F1B", "line", False, "Schedule1F1B", None),
    Kind("interleaved-1f1b", "Interleaved1F1B", "loop", False, "ScheduleInterleaved1F1B",
         "interleaved_1f1b"),
    Kind("looped-bfs", "LoopedBFS", "loop", False, "ScheduleLoopedBFS", "looped_bfs"),
    # torch has no class for ZB-H1 itself (its ScheduleInterleavedZeroBubble orders differently)
    Kind("zb-h1", "ZBH1", "line", True, None, "zb_h1"),
    Kind("zbv", "ZBV", "v", True, "ScheduleZBVZeroBubble", "zbv"),
    Kind("dualpipev", "DualPipeV", "v", True, "ScheduleDualPipeV", "dualpipev"),
)
#: Every kind by name, the non-pipelined ones included.
KINDS_BY_NAME: Dict[str, Kind] = {k.name: k for k in PIPELINED}
for _kind in (Kind("sharded", "Sharded", "line", False, None, None),
              Kind("inference", "Inference", "line", False, None, None),
              Kind("sharded-inference", "ShardedInference", "line", False, None, None)):
    KINDS_BY_NAME[_kind.name] = _kind

#: kind -> ``pipelineSchedule`` name, for the pipelined kinds.
PIPELINED_KINDS: Dict[str, str] = {k.name: k.title for k in PIPELINED}
KINDS: Tuple[str, ...] = tuple(KINDS_BY_NAME)
#: ``Options.pipelineSchedule``'s accepted names, 1F1B first.
SCHEDULE_TITLES: Tuple[str, ...] = tuple(k.title for k in PIPELINED)
LOOPED: Tuple[str, ...] = tuple(k.name for k in PIPELINED if k.placement == "loop")
V_SHAPED: Tuple[str, ...] = tuple(k.name for k in PIPELINED if k.placement == "v")
#: Schedules whose backward is split into I and W actions.
SPLIT_BACKWARD: Tuple[str, ...] = tuple(k.name for k in PIPELINED if k.split_backward)


def kind_of(name: str) -> Optional[str]:
    """ipukit's kind for a schedule name (``"Interleaved1F1B"``, ``"zbv"``...), or None."""
    if not isinstance(name, str):
        return None
    key = name.replace("_", "").replace("-", "").replace(" ", "").lower()
    for kind in KINDS_BY_NAME.values():
        if key in (kind.name.replace("-", ""), kind.title.lower()):
            return kind.name
    return None


def title_of(kind) -> str:
    """A schedule's name as the options spell it (``1F1B``, ``GPipe``, ``Sharded``)."""
    found = KINDS_BY_NAME.get(str(kind).lower())
    return found.title if found is not None else str(kind)
