"""Timing GPU work with CUDA events: one synchronisation per call, not one per action.

Each action records a CUDA event before and after its work on the device's stream (a host
clock would say when work was queued, and a synchronisation per action would stop the host
queueing ahead); after the call, one synchronisation per device turns the events into
host-clock times through a reference event.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Tuple

import torch


class GpuClock:
    """Collects CUDA event pairs during a call and resolves them into host times after it."""

    def __init__(self) -> None:
        self._refs: Dict[torch.device, Tuple[torch.cuda.Event, float]] = {}
        self._pending: List[tuple] = []
        self._lock = threading.Lock()

    def mark(self, device: torch.device) -> "torch.cuda.Event":
        """An event recorded now on ``device``'s current stream."""
        with torch.cuda.device(device):
            if device not in self._refs:
                with self._lock:
                    if device not in self._refs:
                        torch.cuda.synchronize(device)  # idle: the reference runs at once
                        ref = torch.cuda.Event(enable_timing=True)
                        ref.record()
                        self._refs[device] = (ref, time.perf_counter())
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return event

    def later(self, events: list, index: int, device: torch.device, begin, end) -> None:
        """``events[index]`` gets its start and end from ``begin``/``end`` in :meth:`resolve`."""
        with self._lock:
            self._pending.append((events, index, device, begin, end))

    def resolve(self, t0: float) -> None:
        """Synchronise each device once and write the measured spans into the events."""
        for device in self._refs:
            torch.cuda.synchronize(device)
        for events, index, device, begin, end in self._pending:
            ref, t_ref = self._refs[device]
            start = t_ref + ref.elapsed_time(begin) / 1e3 - t0
            stop = t_ref + ref.elapsed_time(end) / 1e3 - t0
            events[index] = events[index]._replace(start=start, end=max(start, stop))
        self._pending.clear()

    def seconds(self, device: torch.device, event: "torch.cuda.Event") -> float:
        """The host-clock time of ``event``, recorded on ``device`` (after :meth:`resolve`)."""
        ref, t_ref = self._refs[device]
        return t_ref + ref.elapsed_time(event) / 1e3


def settle(tensors) -> None:
    """Wait for the GPU work queued on the devices ``tensors`` live on (none on a CPU), so the
    host clock can time a piece of GPU work alone.
    """
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}
    for device in devices:
        torch.cuda.synchronize(device)


def on_device_of(tensors, args: tuple) -> tuple:
    """``args`` with each tensor moved to the device of the first of ``tensors`` (a
    module's parameters, say); unchanged where there are none."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None:
        return tuple(args)
    return tuple(a.to(first.device) if isinstance(a, torch.Tensor) else a for a in args)
