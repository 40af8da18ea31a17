"""The stall watchdog of stages as processes: progress measured across every process.

Each process counts the actions its stages complete; a daemon thread publishes the count in
the rendezvous store and reads every process's. When none changed for
``Options.stallTimeout`` seconds while every process was inside a call, each process writes
what it was doing (its last action, the one it is at, whether it waits for a peer or is
inside the user's operation) to the store, and the error names every process. It then cuts
this process's process-group connections so every wait ends; the calling thread raises the
:class:`~ipukit.core.errors.StallError` through the abort path, and the next call builds the
group afresh. A process inside a user's operation raises when the operation returns.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Dict, Optional

from ...core.errors import StallError
from ...schedules.ir import BACKWARD, FORWARD, INPUT_GRAD, Action
from .. import watchdog as stall
from .group import cut_connections

_STAGES = __file__.replace("watchdog.py", "stages.py")


def _inside_stage(frame) -> bool:
    """Whether the calling thread is inside a stage body's forward (the user's operations)."""
    f = frame
    while f is not None:
        if f.f_code.co_name == "forward" and f.f_code.co_filename == _STAGES:
            return True
        f = f.f_back
    return False


class ProcessWatchdog:
    """Watches one process's calls; ``fired`` is the call's StallError once it stalled."""

    def __init__(self, timeout: float, ctx, layout, num_stages: int, store) -> None:
        self.timeout = timeout
        self.ctx = ctx
        self.lay = layout
        self.num_stages = num_stages
        self.store = store
        self.keys = [f"ipukit/watch/{r}" for r in range(layout.world)]
        self.active = threading.Event()
        #: set when the watchdog starts firing / once it has fired and cut the connections
        self.firing, self.settled = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self.fired: Optional[StallError] = None
        self.call = 0
        self.caller = threading.get_ident()
        self.thread: Optional[threading.Thread] = None
        self.closed = False

    def begin(self, call: int) -> None:
        """A call starts on this (the calling) thread."""
        self.call, self.fired = call, None
        self.firing.clear()
        self.settled.clear()
        self.ctx.done, self.ctx.stop = 0, None
        self.caller = threading.get_ident()
        self.store.set(self.keys[self.lay.rank], f"{call}:0")
        self.active.set()
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="ipukit-watchdog", daemon=True)
            self.thread.start()

    def end(self) -> None:
        """The call ended here: until this process's next call, its peers do not count the
        time they wait for it (a process that checkpoints between calls is not a stall)."""
        self.active.clear()
        try:
            self.store.set(self.keys[self.lay.rank], f"{self.call}:idle")
        except Exception:  # noqa: BLE001 - the store is gone
            pass

    def close(self) -> None:
        """End the watch thread (the runtime is dropped)."""
        self.closed = True
        self.active.set()

    def verdict(self, lost_contact: bool = False) -> Optional[StallError]:
        """This call's StallError if the watchdog fired (``lost_contact``: the call ended with a broken
        connection; a peer fired first, so this process fires too).
        """
        if lost_contact and not self.firing.is_set() and self._peer_fired():
            self._fire()
        if self.firing.is_set():
            self.settled.wait(10.0)
        return self.fired

    def _peer_fired(self) -> bool:
        prefix = f"ipukit/stall/{self.call}/"
        try:
            return any(self.store.check([prefix + str(r)]) for r in range(self.lay.world)
                       if r != self.lay.rank)
        except Exception:  # noqa: BLE001 - the store is gone
            return False

    def _loop(self) -> None:
        poll = min(1.0, self.timeout / 8)  # store round trips: a few a second at most
        key = self.keys[self.lay.rank]
        while True:
            self.active.wait()
            seen, since, published = None, time.monotonic(), None
            try:
                while self.active.is_set() and self.fired is None and not self.closed:
                    n = self.ctx.done
                    if n != published:
                        self.store.set(key, f"{self.call}:{n}")
                        published = n
                    # None: a peer has not made its first call yet (so it is outside one)
                    values = tuple(self.store.multi_get(self.keys)) \
                        if self.store.check(self.keys) else None
                    now = time.monotonic()
                    if values is None or values != seen or any(v.endswith(b":idle")
                                                               for v in values):
                        seen, since = values, now
                    elif now - since >= self.timeout:
                        self._fire()
                        break
                    time.sleep(poll)
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending anyway
                return
            while self.active.is_set() and not self.closed:  # fired: wait for the call's end
                time.sleep(poll)
            if self.closed:
                return

    # -- when it fires ------------------------------------------------------------------

    def _mine(self) -> Dict[str, Any]:
        lay, ctx = self.lay, self.ctx
        lane = list(lay.lanes[lay.pp_rank])
        L = max(1, len(lane))
        done = max(0, min(len(lane), ctx.done - ctx.iteration * L))
        frame = sys._current_frames().get(self.caller)
        inside = waits = waits_on = None
        if frame is not None and _inside_stage(frame) and done < len(lane):
            inside = stall.operation(frame) or f"the module of stage {lane[done].stage}"
        elif done < len(lane):
            a = lane[done]
            if a.kind == FORWARD and a.stage > 0:
                src = a.stage - 1
                waits = (f"{src}F{a.micro_batch}'s output from stage {src} (process "
                         f"{self._rank_of(src)})")
                waits_on = (src, lay.replica)
            elif a.kind in (BACKWARD, INPUT_GRAD) and a.stage < self.num_stages - 1:
                nxt = a.stage + 1
                waits = (f"the gradient of micro-batch {a.micro_batch} from stage {nxt} "
                         f"(process {self._rank_of(nxt)})")
                waits_on = (nxt, lay.replica)
        return {"rank": lay.rank, "actions": [str(a) for a in lane], "done": done,
                "iteration": ctx.iteration, "inside": inside, "waits": waits,
                "waits_on": waits_on,
                "label": f"process {lay.rank} (virtual IPU {lay.ipu}"
                         + (f", replica {lay.replica})" if lay.dp > 1 else ")")}

    def _rank_of(self, stage: int) -> int:
        return self.lay.replica * self.lay.pp + self.lay.stage_rank[stage]

    def _fire(self) -> None:
        with self._lock:  # the watch thread, or the calling thread after a peer fired
            if self.firing.is_set():
                return
            self.firing.set()
        try:
            self._stop()
        finally:
            self.settled.set()

    def _stop(self) -> None:
        mine = self._mine()
        prefix = f"ipukit/stall/{self.call}/"
        self.store.set(prefix + str(self.lay.rank), json.dumps(mine))
        keys = [prefix + str(r) for r in range(self.lay.world)]
        deadline = time.monotonic() + min(2.0, self.timeout)
        found: Dict[int, dict] = {self.lay.rank: mine}
        while time.monotonic() < deadline and len(found) < len(keys):
            for r, k in enumerate(keys):
                if r not in found and self.store.check([k]):
                    found[r] = json.loads(self.store.get(k))
            time.sleep(0.05)
        lanes = []
        for r in sorted(found):
            d = found[r]
            lanes.append(stall.Lane(f"process {r}", d["label"],
                                    [Action.from_str(t) for t in d["actions"]], d["done"],
                                    d["waits"], tuple(d["waits_on"]) if d["waits_on"] else None,
                                    d["inside"], d["done"] >= len(d["actions"])))
        by_rank = {int(ln.name.split()[1]): ln for ln in lanes}

        def find(stage: int, replica: int):
            return by_rank.get(replica * self.lay.pp + self.lay.stage_rank[stage])

        text = stall.message(self.timeout, "process", lanes, stall.cause_of(lanes, find))
        missing = [r for r in range(self.lay.world) if r not in found]
        if missing:
            text += f"\nProcess(es) {missing} did not say what they were doing."
        text += ("\nThe process group was torn down; the next call builds a fresh one (every "
                 "process must make it).")
        if mine["inside"]:
            text += (f"\nThis process (process {self.lay.rank}) is inside a user's operation "
                     f"({mine['inside']}), which cannot be stopped from outside: the call "
                     "raises this error when the operation returns.")
            print(text, file=sys.stderr, flush=True)  # it may never return
        error = StallError(text)
        error.lanes = lanes
        cut_connections()  # before the calling thread can see the error and tear down
        self.fired = error
        self.ctx.stop = error
