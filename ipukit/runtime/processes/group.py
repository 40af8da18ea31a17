"""The run's process group: joining it (gloo, or NCCL for CUDA tensors, under
``IPUKIT_DIST_TIMEOUT``), and recording a failing rank's error in the rendezvous store so its
peers, which see only a broken connection, can name it.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Optional

import torch

from ...core.errors import Error, needs_extra

_FAILED_KEY = "ipukit/failed"


class DistributedError(Error):
    """A multi-process run that cannot start or continue (wrong process count, mismatch, a failed peer)."""


def is_active(options) -> bool:
    """Whether models with these options run as processes (several processes configured)."""
    return options.Distributed.numProcesses > 1


# -- the one adapter onto the compiled model -----------------------------------------------


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("IPUKIT_DIST_TIMEOUT", "300")))


def _wants_cuda(options) -> bool:
    mapping = options.device_mapping
    if mapping:
        return any(str(d).startswith("cuda") for d in mapping)
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


#: The oldest torch the process runtime was run against (torch 2.11 runs ipukit's threads,
#: but its pipeline schedules' step() takes no pre-split micro-batches).
PROCESS_RUNTIME_TORCH = (2, 14)


def torch_release() -> tuple:
    """torch's (major, minor)."""
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def ensure_process_group(options) -> None:
    """Join the run's process group (gloo on CPU; NCCL for CUDA tensors, gloo for the rest)."""
    import torch.distributed as dist

    with needs_extra("distributed", "ipukit's process runtime (torch.distributed's object "
                                    "collectives)"):
        import numpy  # noqa: F401  (torch needs it there, and does not require it itself)
    if torch_release() < PROCESS_RUNTIME_TORCH:
        raise Error(
            f"ipukit's process runtime needs torch {'.'.join(map(str, PROCESS_RUNTIME_TORCH))} "
            f"or later (its schedules' step(arg_mbs=...)); this is torch {torch.__version__}. "
            "Run the model on threads (without ipukit-run), or install a newer torch.")

    d = options.Distributed
    if dist.is_initialized():
        if dist.get_world_size() != d.numProcesses or dist.get_rank() != d.processId:
            raise DistributedError(
                f"Options.Distributed says process {d.processId} of {d.numProcesses}, but the "
                f"process group is rank {dist.get_rank()} of {dist.get_world_size()}: build "
                "the Options inside the launched script (torchrun sets RANK/WORLD_SIZE), or "
                "call Options.Distributed.configureProcessId(rank, world_size).")
        return
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise DistributedError(
                f"Options.Distributed: {d.numProcesses} processes are configured but {var} is "
                "not set, so there is no rendezvous to join. Launch the script with "
                "`ipukit-run --nproc N script.py` (or torchrun), or call "
                "Options.Distributed.disable() to run in one process.")
    backend = "cpu:gloo,cuda:nccl" if _wants_cuda(options) else "gloo"
    store = None
    if _REBUILT["store"] is not None:  # after a stall: a fresh group on the same rendezvous
        store = dist.PrefixStore(f"ipukit/rebuilt/{_REBUILT['count']}/", _REBUILT["store"])
    if _wants_cuda(options):
        gpus = torch.cuda.device_count()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", d.numProcesses))
        if per_node > gpus:
            raise DistributedError(
                f"ipukit: {per_node} processes on this machine but {gpus} CUDA device(s): NCCL "
                "needs a GPU per process. Launch at most that many processes per machine, or "
                "run the stages on CPU with Options.deviceMapping(['cpu']).")
        local = int(os.environ.get("LOCAL_RANK", d.processId))
        torch.cuda.set_device(local % gpus)
    try:
        dist.init_process_group(backend, rank=d.processId, world_size=d.numProcesses,
                                timeout=_timeout(), store=store)
    except Exception as exc:  # noqa: BLE001 - re-raised with the setting to check
        raise DistributedError(
            f"ipukit could not join the process group at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} as rank {d.processId} of {d.numProcesses} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Launch "
            "every process with ipukit-run/torchrun and the same rendezvous.") from exc
    if store is None:  # once: a rebuilt group keeps the first one's report
        _install_failure_report()


#: the rendezvous store kept when a stalled call tore the process group down, and how many
#: times that happened (every process of the run counts the same stalls)
_REBUILT = {"store": None, "count": 0}


def teardown_process_group() -> None:
    """Tear the process group down after a stopped call; the next call builds a fresh one under a
    prefix of its own in the kept rendezvous store.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        store = None
    _exit_without_finalizing()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - its connections are already cut
        pass
    if store is not None:
        if isinstance(store, dist.PrefixStore):  # a rebuilt group's: keep the base store
            store = _REBUILT["store"] or store
        _REBUILT["store"] = store
        _REBUILT["count"] += 1


_UNCAUGHT = {"failed": False, "armed": False}


def _exit_without_finalizing() -> None:
    """After a group was torn down, end the process at exit without the interpreter's
    finalization (destroying the torn-down gloo group then can abort the process); streams are
    flushed, the status is 1 after an uncaught exception, else 0.
    """
    import atexit
    import logging

    if _UNCAUGHT["armed"]:
        return
    _UNCAUGHT["armed"] = True

    def leave() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - closed already
                pass
        os._exit(1 if _UNCAUGHT["failed"] else 0)

    atexit.register(leave)


def default_store():
    """The default process group's rendezvous store."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def cut_connections() -> int:
    """Shut this process's process-group sockets (all but the rendezvous store's), so a wait for a
    peer ends at once here and on the peers (gloo cannot end a pending receive). Linux only.
    """
    import socket

    port = int(os.environ.get("MASTER_PORT", "0") or 0)
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) < 10 or cols[3] != "01":  # ESTABLISHED only
                        continue
                    local = int(cols[1].rsplit(":", 1)[1], 16)
                    remote = int(cols[2].rsplit(":", 1)[1], 16)
                    if port and port in (local, remote):
                        continue  # the rendezvous store: the next group needs it
                    inodes.add(cols[9])
        except OSError:
            return 0
    shut = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            try:
                sock = socket.socket(fileno=int(fd))
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:
                pass
            finally:
                sock.detach()  # the fd stays gloo's
    return shut


def _install_failure_report() -> None:
    """An uncaught exception tells the peers (and ipukit-run) which rank failed and why."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        _UNCAUGHT["failed"] = True
        note_failure(value, uncaught=True)
        previous(kind, value, tb)

    sys.excepthook = hook


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def note_failure(exc: BaseException, uncaught: bool = False) -> None:
    """Tell the peers (through the store) that this rank failed, and why; under ipukit-run an
    exception that ends the process is also written to ``IPUKIT_FAILURE_DIR`` for the launcher.
    """
    import torch.distributed as dist

    if isinstance(exc, DistributedError) and getattr(exc, "_peer", False):
        return  # a consequence of another rank's failure, not a cause
    rank = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))
    line = f"rank {rank}: {_describe(exc)}"
    now = time.time()
    folder = os.environ.get("IPUKIT_FAILURE_DIR")
    if folder and uncaught:
        try:
            with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
                f.write(f"{now}\n{line}\n")
        except OSError:
            pass
    try:
        dist.distributed_c10d._get_default_store().set(_FAILED_KEY, f"{now}|{line}")
    except Exception:  # noqa: BLE001 - best effort: the store may be gone
        pass


def peer_failure(since: float, wait: float = 3.0) -> Optional[str]:
    """The failure another rank recorded after ``since``, waiting briefly for it."""
    import torch.distributed as dist

    deadline = time.monotonic() + wait
    while True:
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.check([_FAILED_KEY]):
                stamp, _, line = store.get(_FAILED_KEY).decode().partition("|")
                if float(stamp) >= since:
                    return line
        except Exception:  # noqa: BLE001
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset",
                                   "Gloo", "gloo", "NCCL", "Timed out", "timed out"))


def device_for(options, ipu: int) -> torch.device:
    mapping = options.device_mapping
    if mapping:
        return torch.device(mapping[ipu % len(mapping)])
    if _wants_cuda(options):
        local = int(os.environ.get("LOCAL_RANK", options.Distributed.processId))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")
