"""Every pipeline schedule on the explorer's current model, split, batching and costs (modeled).

The explorer's stages are fixed; each schedule places them as it needs
(:func:`ipukit.widgets.logic.placed`: a V puts two stages per IPU, so uses half as many).
:func:`schedule_rows` models each with :func:`~ipukit.widgets.logic.modeled_view`, so the
selected schedule's row is the summary's numbers. Nothing here imports ipywidgets.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from ..timeline.compare import peak_activations
from ..timeline.events import Timeline
from . import logic
from .logic import Config, CostTable


@dataclass
class ScheduleRow:
    """One schedule's modeled call: speed, bubble, activation memory (or why it cannot run)."""

    schedule: str                          # the Options.pipelineSchedule name
    kind: str
    ipus: int = 0
    available: bool = True
    reason: str = ""
    time_per_step: Optional[float] = None         # seconds per optimiser step
    samples_per_second: Optional[float] = None
    bubble: Optional[float] = None                # fill and drain, share of all IPU time
    peak_activations: Optional[float] = None      # the fullest IPU, in stage × micro-batch units

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def held_per_ipu(timeline: Timeline, stage_ipus) -> List[float]:
    """Per IPU, the most micro-batch activations its stages hold at once, in units of one
    stage's activations of one micro-batch (a V's IPU holding two stages counts both)."""
    stages_on = Counter(stage_ipus)
    return [w * stages_on[ipu] for ipu, w in enumerate(peak_activations(timeline, list(stage_ipus)))]


def schedule_row(config: Config, schedule: str, costs: CostTable, samples_per_epoch: int,
                 parameters: int = 0) -> ScheduleRow:
    """``config`` pipelined with ``schedule`` and its stages placed so, modeled (unavailable,
    with the reason, when the stages cannot be placed so)."""
    kind = config.with_(schedule=schedule, sharded=False).schedule_kind
    try:
        placed = logic.placed(config.with_(schedule=schedule, sharded=False,
                                           ipus=config.model_ipus))
        view = logic.modeled_view(placed, costs, samples_per_epoch, parameters=parameters)
    except (ValueError, logic.Error) as exc:
        return ScheduleRow(schedule, kind, available=False, reason=str(exc))
    held = held_per_ipu(view.timeline, placed.stage_ipus)
    return ScheduleRow(schedule, kind, ipus=len(set(placed.stage_ipus)),
                       time_per_step=view.time_per_step,
                       samples_per_second=view.samples_per_second, bubble=view.bubble,
                       peak_activations=max(held) if held else 0.0)


def schedule_rows(config: Config, costs: CostTable, samples_per_epoch: int,
                  parameters: int = 0) -> List[ScheduleRow]:
    """:func:`schedule_row` of every schedule in :data:`ipukit.widgets.logic.SCHEDULES`."""
    return [schedule_row(config, name, costs, samples_per_epoch, parameters)
            for name in logic.SCHEDULES]


# -- the table in docs/schedules.md ------------------------------------------------------------

def schedule_table(num_ipus: int = 4, micro_batches=(8, 32), forward_cost: float = 1.0,
                   backward_cost: float = 2.0) -> str:
    """The table in docs/schedules.md of every schedule's bubble and memory, from
    :func:`ipukit.compare_schedules` with equal costs on the same ``num_ipus`` IPUs.
    ``python -m ipukit.widgets.comparison`` prints it."""
    from ..timeline.compare import compare_schedules

    runs = {m: compare_schedules(num_ipus, m, forward_cost=forward_cost,
                                 backward_cost=backward_cost) for m in micro_batches}
    first = micro_batches[0]
    head = (["schedule", f"stages on {num_ipus} IPUs"]
            + [f"step, M = {m} (units)" for m in micro_batches]
            + [f"bubble, M = {m}" for m in micro_batches]
            + [f"peak activations per IPU, M = {first}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind, s in runs[first].items():
        cells = [f"`\"{s.name}\"`", str(s.num_stages)]
        cells += [f"{runs[m][kind].step_time:g}" for m in micro_batches]
        cells += [f"{100 * runs[m][kind].bubble:.1f} %" for m in micro_batches]
        cells.append(", ".join(f"{a:g}" for a in s.peak_activations))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(schedule_table())
