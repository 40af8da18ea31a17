"""Each pass's memory, measured on its stage alone, and the memory model calibrated on it.

A research instrument of the memory benchmark (``python -m benchmarks.memory``), not
library: :func:`stage_transients` runs one micro-batch's ``F``, ``B``, ``I`` and ``W`` of
each stage alone under ipukit's memory tracker (the executor's own code, after the call),
and :func:`ipu_pass_peak` walks each IPU's lane adding those transients to the stashes.
:func:`calibrated_columns` puts that model beside a call's :func:`measured_memory` rows.
It reads ipukit's private runtime pieces, so it follows them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ipukit.core.ops import running_on_ipu
from ipukit.runtime.actions import ActionRunner
from ipukit.runtime.memory_track import CallMemory, _storage
from ipukit.schedules.ir import (Action, BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD,
                                 Schedule)
from ipukit.viz.memory import (MeasuredMemory, ipu_stash_peak, recompute_bytes,
                               unchanged_state)


class _Mailbox(dict):
    """The calibration's mailboxes (one thread: a dict)."""

    aborted = False
    put, take = dict.__setitem__, dict.pop


def _synthetic_row(plan) -> list:
    """One micro-batch of inputs with the compiled shapes and dtypes (values: None)."""
    row: list = []
    for entry in plan.signature:
        if entry[0] != "tensor":
            row.append(None)
            continue
        _, shape, dtype = entry
        row.append(torch.randn(shape, dtype=dtype) if dtype.is_floating_point
                   else torch.zeros(shape, dtype=dtype))
    return row


def stage_transients(plan, row: Optional[list] = None) -> List[Dict[str, int]]:
    """Per stage, the bytes each pass of one micro-batch needs beyond what it holds, measured
    on that stage alone (the executor's own forward, backward and split-backward code).

    ``row``: one micro-batch of the model's flat inputs (default synthetic ones). Each
    stage's inputs come from a forward of the stages before it (outside the tracker); the
    gradients it would receive are ones, made outside too (they count on their sender);
    its gradient accumulators exist already (a later micro-batch's backward). Under a
    :class:`CallMemory` of its own, bytes relative to the level before the forward:
    ``held`` (after ``F``: the stash of one micro-batch as the tracker counts it),
    ``forward`` (``F``'s peak − ``held``), ``backward`` (``B``'s peak − ``held``),
    ``input_grad`` (``I``'s peak − ``held``), ``between`` (what ``I`` leaves for ``W``
    beyond ``held``: captured gradients, a recomputed graph), ``weight_grad`` (``W``'s
    peak − what ``I`` left), ``sent`` (the input gradients a backward sends to the stages
    before it: they count here until the receiver drops them). Gradients sent count in the
    pass's peak, then are dropped. Weights, buffers and random state are left as they were.
    """
    stages = plan.partition.stages
    box = _Mailbox()
    accumulators = {(0, s): [torch.zeros_like(p) for p in plan.trainable[s]]
                    for s in range(len(stages))}
    result: List[Dict[str, int]] = []
    with unchanged_state(st.module for st in stages), torch.enable_grad(), running_on_ipu():
        row = _synthetic_row(plan) if row is None else list(row)   # (the random state kept)
        runner = ActionRunner(plan, 1, [row], 1, box, [[None] * len(plan.partition.outputs)],
                              accumulators, 1.0, False)
        received: Dict[int, dict] = {}   # stage -> its input mailboxes, from a plain forward
        returned: Dict[int, dict] = {}   # stage -> the gradients its consumers send back
        for st in stages:
            received[st.index] = {k: v for k, v in box.items() if k[0] == "A" and k[1] == st.index}
            stash: dict = {}
            runner.forward(Action(FORWARD, st.index, 0), 0, stash)
            outs = stash[(st.index, 0, 0)][1]
            returned[st.index] = {("G", st.index, c, pos, 0, 0, 0): torch.ones_like(outs[item])
                                  for c, pos, item in plan.consumers[st.index]
                                  if isinstance(outs[item], torch.Tensor)
                                  and outs[item].requires_grad}
        box.clear()
        for st in stages:
            s, entry = st.index, {"stage": st.index, "ipu": st.ipu}
            for split in (False, True):
                entry.update(_one_stage(plan, runner, box, s, received[s], returned[s], split,
                                        row, (Action(FORWARD, s, 0), Action(BACKWARD, s, 0),
                                              Action(INPUT_GRAD, s, 0), Action(WEIGHT_GRAD, s, 0))))
            result.append(entry)
    return result


def _one_stage(plan, runner, box, s: int, received: dict, returned: dict, split: bool, row,
               actions) -> Dict[str, int]:
    """One micro-batch through stage ``s`` alone, tracked: ``F`` then ``B`` (or ``I``, ``W``)."""
    f, b, i, w = actions
    ipu = plan.partition.stages[s].ipu
    memory = CallMemory(plan, None, 1, None, inputs=[row])
    track = memory.tracks[(0, ipu)]
    box.clear()
    box.update(received)
    stash: dict = {}
    out: Dict[str, int] = {}
    try:
        with memory.thread(0, ipu):
            with memory.lock:   # the accumulators exist already (a later micro-batch's B)
                for acc in runner.accumulators[(0, s)]:
                    memory._hold(track, acc)
            base = track.level
            runner.forward(f, 0, stash)
            held = track.level - base
            out["held"] = held
            out["forward"] = track.peak - base - held
            box.clear()           # published to the consumers: the same tensors as the stash
            box.update(returned)  # what the consumers send back (made, and counted, there)
            track.peak = track.level
            if not split:
                runner.backward(b, 0, stash)
                out["backward"] = track.peak - base - held
                out["sent"] = _sent_bytes(box, s)
            else:
                runner.input_grad(i, 0, stash)
                out["input_grad"] = track.peak - base - held
                box.clear()   # the input gradients sent: the previous stage takes them
                left = track.level - base
                out["between"] = left - held
                track.peak = track.level
                runner.weight_grad(w, 0, stash)
                out["weight_grad"] = track.peak - base - left
            box.clear()
            stash.clear()
    finally:
        memory.finish()
    return out


def _sent_bytes(box: dict, s: int) -> int:
    """Bytes of the gradients stage ``s`` put in its producers' mailboxes (one per storage)."""
    seen: Dict[int, int] = {}
    for k, v in box.items():
        if k[0] == "G" and k[2] == s and isinstance(v, torch.Tensor) and (st := _storage(v)):
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def ipu_pass_peak(schedule: Schedule, per_micro_batch: Sequence[int],
                  transients: Sequence[Dict[str, int]],
                  accumulators: Optional[Sequence[int]] = None) -> Dict[int, Tuple[int, int]]:
    """Per virtual IPU: (peak bytes above the static ones during a pass, peak between passes).

    Walks each IPU's lane as :func:`ipu_stash_peak` does; during each pass the level is what
    its IPU holds before it plus that pass's own transient, measured on its stage alone
    (``transients[s]``: ``forward`` on top of the new stash, ``backward``, ``input_grad``
    and ``weight_grad`` on top of what the pass starts with; a split backward's ``between``
    is kept from ``I`` to ``W``; the input gradients a backward sends, ``sent``, are counted
    until the IPU's next backward: the receiver's backward drops them by then). A
    recomputing stage's ``backward`` includes its rebuilt activations (it was measured doing
    so), so no separate rebuilt term is added. ``accumulators[s]``: the bytes of stage ``s``'s
    gradient accumulators, counted in the static bytes but made by its first backward (or
    ``W``) of the call, whose fresh gradients become them: until then the walk subtracts them.
    """
    out: Dict[int, Tuple[int, int]] = {}
    if not schedule.training:
        return {ipu: (0, 0) for ipu in set(schedule.stage_ipus)}
    accumulators = list(accumulators) if accumulators is not None else [0] * len(transients)
    for lane in schedule.lanes:
        # the lane's stages have no accumulators until their first backward makes them
        level = -sum(accumulators[s] for s in {a.stage for a in lane})
        top = held = sent = 0
        made = set()
        for a in lane:
            s, t = a.stage, transients[a.stage]
            held = max(held, level + sent)
            if a.kind == FORWARD:
                level += per_micro_batch[s]
                top = max(top, level + sent + t.get("forward", 0))
            elif a.kind == BACKWARD:
                top = max(top, level + sent + t.get("backward", 0))
                level -= per_micro_batch[s]
            elif a.kind == INPUT_GRAD:
                top = max(top, level + sent + t.get("input_grad", 0))
                level += t.get("between", 0)
            elif a.kind == WEIGHT_GRAD:
                top = max(top, level + sent + t.get("weight_grad", 0))
                level -= per_micro_batch[s] + t.get("between", 0)
            # a backward's input gradients count here until the receiver's backward drops
            # them: assumed before this IPU's next backward sends the next ones
            if a.kind in (BACKWARD, INPUT_GRAD):
                sent = t.get("sent", 0)
            if a.kind in (BACKWARD, WEIGHT_GRAD) and s not in made:   # its fresh gradients stay
                made.add(s)
                level += accumulators[s]
        for ipu in {schedule.stage_ipus[a.stage] for a in lane}:
            old = out.get(ipu, (0, 0))
            out[ipu] = (max(old[0], top), max(old[1], held))
    return out


def calibrated_columns(model, measured: MeasuredMemory,
                       transients: Optional[List[Dict[str, int]]] = None) -> Dict[int, Dict[str, int]]:
    """Per virtual IPU of a tracked call (``measured = measured_memory(model)``): the
    ``calibrated`` peak (static bytes plus :func:`ipu_pass_peak`'s peak during a pass),
    ``calibrated_held`` (between passes) and ``transient`` (what the passes' transients add
    to the stashes walked together). ``transients``: :func:`stage_transients` (default:
    measured now, on a synthetic micro-batch)."""
    plan = model.program
    report = measured.modeled
    transients = stage_transients(plan) if transients is None else transients
    kept = recompute_bytes(model)
    static: Dict[int, int] = {}
    for st in report.stages:
        static[st["ipu"]] = static.get(st["ipu"], 0) + (
            st["parameter_bytes"] + st["gradient_accumulator_bytes"]
            + st["optimizer_state_on_chip_bytes"])
    together = ipu_stash_peak(plan.schedule, [k for k, _ in kept], [r for _, r in kept])
    passes = ipu_pass_peak(plan.schedule, [k for k, _ in kept], transients,
                           [st["gradient_accumulator_bytes"] for st in report.stages])
    return {ipu: {"calibrated": static.get(ipu, 0) + top,
                  "calibrated_held": static.get(ipu, 0) + held,
                  "transient": top - together.get(ipu, 0)}
            for ipu, (top, held) in passes.items()}
