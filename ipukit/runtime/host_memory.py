"""Opt-in: the host allocator keeps the memory it frees, as a device keeps its memory.

A pipelined call frees micro-batches' activations as their backwards run; with glibc's
default settings memory freed at the top of the heap, and blocks above its adaptive
``mmap`` threshold, go back to the operating system, and the next micro-batch faults fresh
pages in, on every call. A device does not pay that (an IPU's memory is laid out at compile
time, a GPU's caching allocator keeps freed blocks). So ipukit can ask glibc (``mallopt``)
to keep what it frees: a very high trim threshold and the mmap threshold at 32 MiB. The
process then keeps its peak of host memory until it exits.

It is off by default because it is process-wide and stays once set:
``Options.keepHostMemory(True)`` applies it at the first call of that model (Linux, glibc
only); ``IPUKIT_KEEP_HOST_MEMORY=1`` turns it on for every model (``0`` keeps it off).
``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` in the environment mean the user
chose: ipukit leaves them alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import threading
from typing import Optional

__all__ = ["keep_freed_memory", "kept", "wanted"]

_log = logging.getLogger(__name__)

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB × sizeof(long))
MMAP_THRESHOLD = 32 * 1024 * 1024
#: the heap is trimmed only past this much free memory at its top: never, in practice
TRIM_THRESHOLD = 2 ** 31 - 1

_state = {"done": False, "kept": None}
_lock = threading.Lock()


def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def kept() -> Optional[bool]:
    """Whether this process's allocator keeps freed memory (None: not decided yet)."""
    return _state["kept"]


def wanted(option: bool) -> bool:
    """Whether a model's call asks for it: its option (off by default), unless
    ``IPUKIT_KEEP_HOST_MEMORY=0``; ``=1`` asks even where the option is off."""
    env = os.environ.get("IPUKIT_KEEP_HOST_MEMORY", "").strip().lower()
    if env in ("0", "false", "no"):
        return False
    return option or env in ("1", "true", "yes")


def keep_freed_memory(enabled: bool = True) -> bool:
    """Make glibc keep the memory it frees, once per process (see the module docstring).

    Returns whether the allocator now keeps freed memory. ``enabled`` False (a model that
    did not ask, the default) does nothing. Off glibc, or when the user set glibc's own
    ``MALLOC_*_THRESHOLD_`` variables, nothing is changed and False is returned; the first
    attempt's result stands for the process.
    """
    if not enabled:
        return bool(_state["kept"])
    if _state["done"]:
        return bool(_state["kept"])
    with _lock:
        if _state["done"]:
            return bool(_state["kept"])
        _state["done"] = True
        _state["kept"] = False
        if any(os.environ.get(v) for v in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")):
            return False
        libc = _glibc()
        if libc is None:
            return False
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
        _state["kept"] = ok
        _log.debug("ipukit: host allocator keeps freed memory: %s", ok)
        return ok
