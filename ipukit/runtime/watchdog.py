"""Stall diagnosis: a call in which no action completes anywhere for ``Options.stallTimeout``.

Each action increments its worker's progress counter; the thread that already waits for the
workers compares their sum a few times a second, so only the time since the last completed
action anywhere counts. When it fires, the call is stopped and undone through the abort
path, and a :class:`~ipukit.core.errors.StallError` says per virtual IPU (or process) the
last action completed, the one it is at, whether it waits for a message or is inside a
user's operation (read from the thread's stack), and the schedule around that point.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..schedules.ir import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action

KIND_WORDS = {FORWARD: "forward", BACKWARD: "backward", INPUT_GRAD: "input-gradient backward",
              WEIGHT_GRAD: "weight-gradient backward"}

_HERE = os.path.dirname(os.path.abspath(__file__))
_IPUKIT = os.path.dirname(_HERE)
_EXAMPLES = os.path.join(_IPUKIT, "examples")
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB = os.path.dirname(os.path.abspath(threading.__file__))
_WORKERS = os.path.join(_HERE, "workers.py")


class Watchdog:
    """Whether the counters in ``progress`` stopped moving for ``timeout`` seconds.

    ``progress`` is a list the workers increment (one slot each, no lock: a
    slot has one writer, and a torn read only delays the verdict by one poll).
    """

    def __init__(self, timeout: float, progress: List[int]) -> None:
        self.timeout = timeout
        self.progress = progress
        self.restart()

    def restart(self) -> None:
        """Count from now (a call or an iteration starts; the host's step is not a stall)."""
        self.seen = sum(self.progress)
        self.since = time.monotonic()

    def stalled(self) -> bool:
        n = sum(self.progress)
        now = time.monotonic()
        if n != self.seen:
            self.seen, self.since = n, now
            return False
        return now - self.since >= self.timeout


def _is_library(filename: str) -> bool:
    """ipukit's runtime, torch and the standard library: not where a user's operation is."""
    path = os.path.abspath(filename)
    if path.startswith(_IPUKIT):
        return not path.startswith(_EXAMPLES)
    return path.startswith(_TORCH) or (path.startswith(_STDLIB) and "-packages" not in path)


def operation(frame) -> Optional[str]:
    """The innermost user operation on a stack (``frame``: its innermost frame), as
    ``Block.forward (model.py:12), in module Block``; None when none is found."""
    op, module = None, None
    f = frame
    while f is not None:
        code = f.f_code
        if op is None and not _is_library(code.co_filename):
            name = getattr(code, "co_qualname", code.co_name)
            op = f"{name} ({os.path.basename(code.co_filename)}:{f.f_lineno})"
        if module is None:
            owner = f.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and not type(owner).__module__.startswith(
                    ("ipukit.", "torch.")):
                module = type(owner).__name__
        if op is not None and module is not None:
            break
        f = f.f_back
    if op is None:
        return None if module is None else f"in module {module}"
    return op if module is None else f"{op}, in module {module}"


def waiting_key(frame) -> Optional[tuple]:
    """The mailbox key a worker thread waits on (inside ``Exchange.take``), else None."""
    f = frame
    while f is not None:
        if f.f_code.co_name == "take" and os.path.abspath(f.f_code.co_filename) == _WORKERS:
            return f.f_locals.get("key")
        f = f.f_back
    return None


def frames() -> Dict[int, Any]:
    return sys._current_frames()


def window(actions: Sequence[Action], at: int, mark: str, before: int = 4,
           after: int = 4) -> str:
    """A lane around position ``at``: done actions, ``[the one it is at: mark]``, the next ones."""
    lo, hi = max(0, at - before), min(len(actions), at + 1 + after)
    done = " ".join(str(a) for a in actions[lo:at])
    if lo > 0:
        done = "… " + done
    if at < len(actions):
        here = f"[{actions[at]} {mark}]"
        rest = " ".join(str(a) for a in actions[at + 1:hi]) + (" …" if hi < len(actions) else "")
    else:
        here, rest = "[done]", ""
    return " ".join(p for p in (done, here, rest) if p)


class Lane:
    """What one worker (a virtual IPU of a replica, or a process) was doing when a call stalled."""

    def __init__(self, name: str, label: str, actions: Sequence[Action], done: int,
                 waits: Optional[str] = None, waits_on: Optional[Tuple[int, int]] = None,
                 inside: Optional[str] = None, finished: bool = False) -> None:
        self.name, self.label = name, label
        self.actions, self.done = list(actions), done
        self.waits, self.waits_on = waits, waits_on   # words; (stage, replica) it waits for
        self.inside = inside          # the user's operation it is inside (None: not inside)
        self.finished = finished

    @property
    def last(self) -> Optional[Action]:
        return self.actions[self.done - 1] if 0 < self.done <= len(self.actions) else None

    @property
    def current(self) -> Optional[Action]:
        return self.actions[self.done] if self.done < len(self.actions) else None

    def state(self) -> str:
        a = self.current
        if a is None or self.finished:
            return "finished its actions of this iteration and waits for the others"
        what = f"{a}, its {KIND_WORDS.get(a.kind, a.kind)} of micro-batch {a.micro_batch}"
        if self.waits is not None:
            return f"waits for {self.waits} (to run {what})"
        if self.inside is not None:
            return f"is still inside {what} (operation {self.inside})"
        return f"is running {what}"

    def line(self) -> str:
        last = self.last
        done = f"last completed {last}" if last is not None else "completed no action yet"
        return f"  {self.label}: {done}; {self.state()}"

    def mark(self) -> str:
        if self.waits is not None:
            return "waits"
        return "inside" if self.inside is not None else "running"


def message(timeout: float, where: str, lanes: Sequence[Lane], cause: Optional[str],
            setting: str = "Options.stallTimeout") -> str:
    """The StallError's text (before any line about threads still running)."""
    out = [f"ipukit: the call made no progress for {timeout:g} s ({setting}({timeout:g})): "
           f"no action completed on any {where}, so it was stopped and undone (weights, "
           "buffers and optimiser state are as before the call)."]
    out += [ln.line() for ln in lanes]
    if cause:
        out.append(f"Cause: {cause}.")
    out.append("Schedule around that point (done, [where each is], to do):")
    out += [f"  {ln.label}: {window(ln.actions, ln.done, ln.mark())}" for ln in lanes]
    out.append(f"If the call is merely slow (one action takes longer than {timeout:g} s), "
               f"raise {setting}(seconds), or turn the watchdog off with {setting}(None).")
    return "\n".join(out)


def cause_of(lanes: Sequence[Lane], find: Callable[[int, int], Optional[Lane]]) -> Optional[str]:
    """Follow the waits from lane to lane to the one that is not waiting (or to a cycle)."""
    for start in lanes:
        if start.waits_on is None:
            continue
        seen, lane = [], start
        while lane is not None and lane.waits_on is not None and lane not in seen:
            seen.append(lane)
            lane = find(*lane.waits_on)
        if lane is None:
            return None
        if lane in seen:
            return "the workers wait for each other in a cycle: " + " -> ".join(
                ln.label for ln in seen[seen.index(lane):] + [lane])
        if lane.inside is not None and lane.current is not None:
            a = lane.current
            return (f"{lane.label} is still inside its {KIND_WORDS.get(a.kind, a.kind)} of "
                    f"micro-batch {a.micro_batch} ({a}; operation {lane.inside}); "
                    + ", ".join(ln.label for ln in seen) + " wait(s) for it")
        return f"{lane.label} {lane.state()}; " + ", ".join(ln.label for ln in seen) + \
            " wait(s) for it"
    inside = [ln for ln in lanes if ln.inside is not None and not ln.finished]
    if inside:
        ln = inside[0]
        return f"{ln.label} is still inside {ln.current} (operation {ln.inside})"
    return None


def stuck_note(alive: Sequence[str], lanes: Sequence[Lane]) -> str:
    """The lines about worker threads still running a user's operation after the stop."""
    if not alive:
        return ""
    ops = {ln.name: ln.inside for ln in lanes}
    named = ", ".join(f"{n} (inside {ops[n]})" if ops.get(n) else n for n in alive)
    return ("\nA worker inside a user's operation cannot be stopped from outside: still "
            f"running: {named}. The call returned anyway; the thread is a daemon thread, and "
            "if its operation ever returns, it runs no further action and its results go to "
            "this stopped call's mailboxes, which nothing reads (what the operation itself "
            "writes before it returns, e.g. a BatchNorm's running statistics, is its own). "
            "Later calls run on new workers.")
