"""The call contract both runtimes keep (threads: :mod:`.executor`; processes: :mod:`.processes.runtime`).

A call cuts the combined batch into micro-batches (:func:`ipukit.core.batching.split`); runs
the schedule's actions, each recorded as an :class:`~ipukit.Event` (:func:`action_event`);
steps the optimiser once per iteration after the flush, the gradients scaled by PopTorch's
Mean/Sum rule and unscaled (:mod:`ipukit.runtime.update`), recorded on every IPU it updates
(:func:`step_events`); returns the rows the output mode keeps
(:func:`ipukit.core.batching.returned_steps`); and on an error or an interrupt stops, joins
and restores the state through the one abort path (:func:`ipukit.runtime.abort.abort_call`).
The runtimes differ only in where the workers live and how activations travel.
"""
from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

from ..core.batching import gather, returned_steps, split  # noqa: F401  (the contract's parts)
from ..timeline.events import Event
from ..timeline.kinds import KIND_NAMES
from .abort import abort_call  # noqa: F401
from .update import StateSnapshot, gradient_scale, step  # noqa: F401


def action_event(stage: int, kind: str, micro_batch: int, start: float, end: float, ipu: int,
                 replica: int, iteration: int, call: int) -> Event:
    """One action's span (``kind`` in the schedule's letters: F, B, I, W), times from t0."""
    return Event(stage, KIND_NAMES[kind], micro_batch, start, end, ipu, replica, iteration, call)


def action_note(action, ipu, replica: int) -> str:
    """The note an error raised inside an action carries: which virtual IPU, what it ran."""
    return (f"(ipukit: raised by virtual IPU {ipu}, replica {replica}, running {action} — "
            f"{KIND_NAMES[action.kind]} of micro-batch {action.micro_batch} on stage "
            f"{action.stage}, iteration {action.iteration})")


def step_events(stage_ipus: Iterable[Tuple[int, int]], replicas: Sequence[int], iteration: int,
                call: int, t_start: float, t_opt: float, t_end: float,
                transfers: Sequence[Tuple[float, float]] = (), t0: float = 0.0) -> List[Event]:
    """The optimiser step of one iteration as the timeline draws it: once on the host, drawn on
    each virtual IPU of the stages it updates (``stage_ipus``) for each of ``replicas``.
    """
    pairs = list(stage_ipus)
    replica0 = replicas[0] if replicas else 0
    events = [Event(s, "step", -1, t_opt - t0, t_end - t0, ipu, r, iteration, call)
              for r in replicas for s, ipu in pairs]
    events += [Event(-1, "transfer", -1, a - t0, b - t0, -1, replica0, iteration, call)
               for a, b in transfers]
    if t_opt - t_start > 0:
        events.append(Event(-1, "host", -1, t_start - t0, t_opt - t0, -1, replica0,
                            iteration, call))
    return events
