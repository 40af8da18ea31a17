"""Measured memory per virtual IPU, during the real call.

While a call runs, each worker thread (one per virtual IPU and replica) runs inside a
thread-local ``TorchDispatchMode``: every storage an operation returns is registered once on
the worker's IPU with its size, and a weak reference records its release, whichever thread
drops it. So an IPU's bytes over time are what is really alive: stashes, autograd's saved
tensors, gradient accumulators and each pass's temporaries. A storage another IPU allocated
counts here too while a tensor this IPU's operations returned on it lives (each IPU holds its
own copy, as separate devices would). The call's inputs are the host's: a micro-batch counts
only while autograd saves it. Parameters, buffers and optimiser state make the baseline. A
sharded call runs every IPU on one thread: one track (``ipu`` -1).

The tracker costs a Python call per operation, so it is opt-in (``with track_memory():``,
``IPUKIT_TRACK_MEMORY=1`` or ``Options.trackMemory(True)``); a tracked call's timeline
carries one :class:`~ipukit.timeline.events.MemoryTrack` per virtual IPU, with the GPU
allocator's peak or the process's peak resident set size (:func:`peak_rss`) beside it.
With stages as processes each process measures its own virtual IPU the same way (torch's
``PipelineStage`` receive buffers are in its baseline, ``parts["receive_buffers"]``).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .._torch import dispatch_mode_class
from ..timeline.events import MemoryTrack

__all__ = ["CallMemory", "track_memory", "tracking", "untracked", "coalesce", "peak_rss"]

_switch = {"depth": 0}
_switch_lock = threading.Lock()
_here = threading.local()   # .mode: this thread's counting mode, inside CallMemory.thread


@contextmanager
def track_memory(enabled: bool = True):
    """Inside: every model call measures its memory per virtual IPU (``Timeline.memory``)."""
    with _switch_lock:
        _switch["depth"] += 1 if enabled else 0
    try:
        yield
    finally:
        with _switch_lock:
            _switch["depth"] -= 1 if enabled else 0


def tracking(plan=None) -> bool:
    """Whether a call starting now measures its memory (:func:`track_memory`,
    ``IPUKIT_TRACK_MEMORY``, or ``plan`` compiled with ``Options.trackMemory(True)``)."""
    return (_switch["depth"] > 0 or bool(getattr(plan, "track_memory", False))
            or os.environ.get("IPUKIT_TRACK_MEMORY", "") not in ("", "0"))


@contextmanager
def untracked():
    """Inside, on a tracked thread, operations count on no virtual IPU (the host's own work done
    there, e.g. the undo copy with stages as processes); elsewhere nothing changes.
    """
    mode = getattr(_here, "mode", None)
    if mode is None or mode.track is None:
        yield
        return
    track, mode.track = mode.track, None
    try:
        yield
    finally:
        mode.track = track


def _storage(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return s if s.nbytes() > 0 else None
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (wrappers, meta)
        return None


class _Saved:
    """A view of the call's input that autograd saved: counted while the graph keeps it."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _unpack(x):
    return x.t if type(x) is _Saved else x


class _Track:
    """One virtual IPU's account: what it holds, and its level over time."""

    __slots__ = ("ipu", "replica", "level", "held", "borrowed", "samples", "peak", "peak_time",
                 "baseline", "parts")

    def __init__(self, ipu: int, replica: int) -> None:
        self.ipu, self.replica = ipu, replica
        self.level = 0
        self.held: Dict[int, int] = {}      # storage key -> bytes
        self.borrowed: Dict[int, list] = {}  # another IPU's storage key -> weakrefs of aliases here
        self.samples: List[Tuple[float, int]] = []
        self.peak, self.peak_time, self.baseline = 0, 0.0, 0
        self.parts: Dict[str, int] = {}


class CallMemory:
    """The memory accounts of one call: one per (replica, virtual IPU)."""

    def __init__(self, plan, schedule, replicas: int, optimizer=None,
                 t0: Optional[float] = None, inputs: Iterable = (),
                 accounts: Optional[Iterable[Tuple[int, int]]] = None,
                 devices: Optional[Dict[int, torch.device]] = None,
                 kept: Optional[Dict[Tuple[int, int], Dict[str, list]]] = None) -> None:
        """``accounts``: the (replica, virtual IPU) pairs measured (default: every one). A
        process running one virtual IPU of one replica measures that one only, on its
        ``devices`` (virtual IPU → torch device; default the plan's); ``kept``, per account,
        part → tensors its runtime keeps for that IPU between calls besides the stages'
        weights (with stages as processes: torch's receive buffers), counted in its baseline
        and not held on to (that would keep alive what the runtime drops during the call)."""
        self.plan, self.optimizer = plan, optimizer
        self.t0 = time.perf_counter() if t0 is None else t0
        self.lock = threading.RLock()   # a release (a weakref callback) may come from GC inside
        self.live: Dict[int, list] = {}      # storage key -> [weakref, bytes, [tracks]]
        self.ignored = set()                 # the call's inputs: the host's
        for row in inputs:
            for v in row:
                if isinstance(v, torch.Tensor) and (s := _storage(v)) is not None:
                    self.ignored.add(id(s))
        if accounts is None:
            ipus = sorted({st.ipu for st in plan.partition.stages})
            accounts = [(r, ipu) for r in range(replicas) for ipu in ipus]
        self.tracks: Dict[Tuple[int, int], _Track] = {key: _Track(key[1], key[0])
                                                      for key in accounts}
        devices = plan.devices if devices is None else devices
        self.devices = {ipu: devices.get(ipu, torch.device("cpu"))
                        for ipu in sorted({ipu for _, ipu in self.tracks})}
        self.cuda = sorted({d.index or 0 for d in self.devices.values() if d.type == "cuda"})
        for d in self.cuda:   # pragma: no cover - GPU only (untested: no GPU here)
            torch.cuda.reset_peak_memory_stats(d)
        self.rss_before = peak_rss()
        kept = kept or {}
        with self.lock:
            for (r, ipu), track in self.tracks.items():
                self._start(track, [ipu], kept.get((r, ipu), {}))

    # -- what each IPU holds before the call -----------------------------------------------
    def _start(self, track: _Track, ipus, kept: Optional[Dict[str, list]] = None) -> None:
        self._baseline(track, ipus, kept or {})
        track.peak_time = now = time.perf_counter() - self.t0
        track.baseline = track.peak = track.level
        track.samples = [(now, track.level)]   # one sample for the whole baseline

    def _stages_of(self, ipus) -> list:
        return [st for st in self.plan.partition.stages if st.ipu in ipus]

    def _baseline(self, track: _Track, ipus, kept: Dict[str, list]) -> None:
        parts = track.parts
        for st in self._stages_of(ipus):
            module = self.plan.module_for(st.index, track.replica)
            for kind, tensors in (("parameters", list(st.parameters)),
                                  ("buffers", list(module.buffers()))):
                for t in tensors:
                    parts[kind] = parts.get(kind, 0) + self._hold(track, t)
                    if kind == "parameters" and t.grad is not None:
                        parts["gradients"] = parts.get("gradients", 0) + self._hold(track, t.grad)
        parts["optimizer_state"] = self._optimizer_state(track, ipus)
        for kind, tensors in kept.items():
            parts[kind] = sum(self._hold(track, t) for t in tensors)

    def _optimizer_state(self, track: _Track, ipus) -> int:
        opt = self.optimizer
        if opt is None or self.plan.offload_optimizer:   # offloaded state lives on the host
            return 0
        added = 0
        for st in self._stages_of(ipus):
            for p in st.parameters:
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        added += self._hold(track, v)
        return added

    def after_step(self) -> None:
        """The host stepped: the optimiser's new state (its first step) lives on each IPU."""
        with self.lock:
            for track in self.tracks.values():
                added = self._optimizer_state(track, list(self.devices) if track.ipu < 0
                                              else [track.ipu])
                if added:
                    track.parts["optimizer_state"] = track.parts.get("optimizer_state", 0) + added

    # -- registration and release ----------------------------------------------------------
    def _hold(self, track: _Track, t: torch.Tensor) -> int:
        """Count ``t``'s storage on ``track`` until it is freed (lock held); bytes added."""
        s = _storage(t)
        if s is None:
            return 0
        key = id(s)
        if key in track.held or key in self.ignored:
            return 0
        return self._count(track, key, s, s.nbytes())

    def _count(self, track: _Track, key: int, obj, nbytes: int) -> int:
        """Count ``nbytes`` on ``track`` until ``obj`` is freed (lock held)."""
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [weakref.ref(obj, self._released(key)), nbytes, []]
        nbytes = entry[1]
        entry[2].append(track)
        track.held[key] = nbytes
        self._move(track, nbytes)
        return nbytes

    def _move(self, track: _Track, delta: int) -> None:
        track.level += delta
        now = time.perf_counter() - self.t0
        track.samples.append((now, track.level))
        if track.level > track.peak:
            track.peak, track.peak_time = track.level, now

    def _released(self, key: int):
        def release(_ref) -> None:
            with self.lock:
                entry = self.live.pop(key, None)
                if entry is None:
                    return
                for track in entry[2]:
                    track.borrowed.pop(key, None)
                    nbytes = track.held.pop(key, None)
                    if nbytes is not None:
                        self._move(track, -nbytes)
        return release

    def saw(self, track: _Track, out) -> None:
        """An operation on ``track``'s thread returned ``out``: count its storages there (one first
        counted on another IPU is *borrowed*: it counts here while a tensor returned here lives).
        """
        if isinstance(out, torch.Tensor):
            s = _storage(out)
            if s is None:
                return
            key = id(s)
            if key in track.held and key not in track.borrowed:
                return
            with self.lock:
                entry = self.live.get(key)
                if entry is None or not entry[2]:
                    self._hold(track, out)
                elif track not in entry[2] or key in track.borrowed:
                    self._borrow(track, key, out, entry)
        elif isinstance(out, (tuple, list)):
            for v in out:
                self.saw(track, v)

    def _borrow(self, track: _Track, key: int, t: torch.Tensor, entry: list) -> None:
        """Count another IPU's storage here while ``t`` (or another alias from here) lives."""
        borrowed = track.borrowed.get(key)
        if borrowed is None:
            borrowed = track.borrowed[key] = []
            entry[2].append(track)
            track.held[key] = entry[1]
            self._move(track, entry[1])
        borrowed.append(weakref.ref(t, self._returned(track, key)))

    def _returned(self, track: _Track, key: int):
        def returned(ref) -> None:
            with self.lock:
                borrowed = track.borrowed.get(key)
                if borrowed is None or ref not in borrowed:
                    return
                borrowed.remove(ref)
                if borrowed:
                    return
                del track.borrowed[key]
                nbytes = track.held.pop(key, None)
                if nbytes is not None:
                    self._move(track, -nbytes)
                entry = self.live.get(key)
                if entry is not None and track in entry[2]:
                    entry[2].remove(track)
        return returned

    @contextmanager
    def thread(self, replica: int, ipu: Optional[int]):
        """Count what this thread's operations allocate on ``(replica, ipu)`` (``ipu`` None: one
        thread runs every IPU, one track -1).
        """
        key = (replica, -1 if ipu is None else ipu)
        if key not in self.tracks:
            with self.lock:
                track = self.tracks[key] = _Track(key[1], replica)
                self._start(track, list(self.devices) if ipu is None else [ipu])
                if ipu is None:   # the per-IPU accounts are not used: one thread, one track
                    for k in [k for k in self.tracks if k[0] == replica and k != key]:
                        self._drop(self.tracks.pop(k))
        track = self.tracks[key]

        def pack(t):   # a host input autograd keeps (a stage's input micro-batch): its bytes
            s = _storage(t)
            if s is None or id(s) not in self.ignored:
                # an alias, not t: a saved output returned as itself would hold its own grad_fn
                # (a reference cycle: the graph would live until the garbage collector runs)
                return t.detach()
            held = _Saved(t)
            with self.lock:
                self._count(track, id(held), held, t.numel() * t.element_size())
            return held

        mode, outer = _mode_class()(self, track), getattr(_here, "mode", None)
        _here.mode = mode
        try:
            with mode, torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield
        finally:
            _here.mode = outer

    def _drop(self, track: _Track) -> None:
        for key in list(track.held):
            entry = self.live.get(key)
            if entry is not None and track in entry[2]:
                entry[2].remove(track)

    # -- the result ------------------------------------------------------------------------
    def finish(self) -> List[MemoryTrack]:
        """The tracks, as the timeline keeps them; storages still alive stay counted as ``end``."""
        allocator = {d: int(torch.cuda.max_memory_allocated(d)) for d in self.cuda}
        rss = (self.rss_before, peak_rss()) if self.rss_before is not None else None
        out = []
        with self.lock:
            for (r, ipu), tr in sorted(self.tracks.items()):
                dev = self.devices.get(ipu)
                cuda = dev is not None and dev.type == "cuda"
                out.append(MemoryTrack(
                    ipu, r, coalesce(tr.samples, tr.peak_time), tr.baseline, tr.peak,
                    tr.peak_time, tr.level, dict(tr.parts),
                    allocator.get(dev.index or 0) if cuda else None,
                    None if cuda else rss))
            self.live.clear()   # stop listening: later releases are not this call's
            for tr in self.tracks.values():
                tr.borrowed.clear()
        return out


def peak_rss() -> Optional[int]:
    """The process's peak resident set size so far, in bytes (None where unknown): a high-water
    mark over the process's life, so a call's figure is the pair before and after it.
    """
    try:
        import resource
    except ImportError:   # pragma: no cover - Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def coalesce(samples: List[Tuple[float, int]], keep: Optional[float] = None,
             resolution: float = 20e-6, most: int = 4000) -> List[Tuple[float, int]]:
    """Fewer (t, bytes) samples, same shape: per time bucket its highest and last level, about
    ``most`` samples in all, the sample at ``keep`` (the peak) always kept.
    """
    if len(samples) <= 2:
        return list(samples)
    span = samples[-1][0] - samples[0][0]
    width = max(resolution, span / max(1, most // 2))
    out: List[Tuple[float, int]] = [samples[0]]
    bucket: List[Tuple[float, int]] = []
    edge = samples[0][0] + width

    def flush() -> None:
        if not bucket:
            return
        top = max(bucket, key=lambda s: s[1])
        peak = [s for s in bucket if keep is not None and s[0] == keep]
        out.extend(sorted({top, bucket[-1], *peak}))
        bucket.clear()

    for s in samples[1:]:
        if s[0] >= edge:
            flush()
            edge = s[0] + width
        bucket.append(s)
    flush()
    return out


_MODE = {}


def _mode_class():
    """The dispatch mode, built once (its base class is torch's private one)."""
    cls = _MODE.get("cls")
    if cls is None:
        base = dispatch_mode_class()

        class _Counting(base):
            def __init__(self, memory: CallMemory, track: _Track) -> None:
                super().__init__()
                self.memory, self.track = memory, track

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if self.track is not None:   # None: inside untracked()
                    self.memory.saw(self.track, out)
                return out

        cls = _MODE["cls"] = _Counting
    return cls
