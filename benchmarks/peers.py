"""The same balanced pipeline on two peers: torchgpipe and torch.distributed.pipelining.

* torchgpipe 0.0.7 (``torchgpipe.GPipe``) runs in this process. It imports
  and runs unchanged on torch 2.14, so no shim is needed. Note that it binds
  one worker thread per *device*, and every CPU partition is the same device
  (``cpu``), so on CPU its partitions never overlap: it is a sequential
  baseline with GPipe's micro-batching, not a concurrent pipeline.
* torch.distributed.pipelining's ``ScheduleGPipe`` runs one process per stage,
  joined by gloo over 127.0.0.1 (started here with torch.multiprocessing);
  each process gets ``cores // stages`` intra-op threads, as ipukit's
  workers do by default.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from typing import List

import torch
import torch.nn.functional as F

from .models import balanced_data, balanced_sequential


def torchgpipe_step(stages: int, width: int, layers: int, micro_batch: int, micro_batches: int):
    """A callable running one torchgpipe training step (forward, loss, backward, SGD)."""
    from torchgpipe import GPipe

    body = balanced_sequential(stages, width, layers)
    model = GPipe(body, balance=[1] * stages, devices=["cpu"] * stages, chunks=micro_batches,
                  checkpoint="never")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = balanced_data(width, micro_batch * micro_batches)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank: int, world: int, port: int, cfg: dict, out_path: str) -> None:
    """One pipeline stage in its own process; rank 0 writes the step times to ``out_path``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        body = balanced_sequential(world, cfg["width"], cfg["layers"])
        module = body[rank]
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=cfg["micro_batches"],
                                 loss_fn=F.cross_entropy)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        x, y = balanced_data(cfg["width"], cfg["micro_batch"] * cfg["micro_batches"])
        times = _dist_steps(rank, world, schedule, optimizer, x, y, cfg["warmup"] + cfg["reps"])
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(times[cfg["warmup"]:], f)
    finally:
        dist.destroy_process_group()


def _dist_steps(rank, world, schedule, optimizer, x, y, count: int) -> List[float]:
    """Time whole steps, every rank aligned by a barrier before and after each."""
    import torch.distributed as dist

    times = []
    for _ in range(count):
        dist.barrier()
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - t)
    return times


def torch_pipelining_times(stages: int, width: int, layers: int, micro_batch: int,
                           micro_batches: int, reps: int, threads: int,
                           warmup: int = 2) -> List[float]:
    """Step times of ScheduleGPipe with one gloo process per stage (loopback only)."""
    import torch.multiprocessing as mp

    cfg = {"width": width, "layers": layers, "micro_batch": micro_batch,
           "micro_batches": micro_batches, "reps": reps, "warmup": warmup, "threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "times.json")
        mp.start_processes(_dist_worker, args=(stages, _free_port(), cfg, out_path),
                           nprocs=stages, join=True, start_method="spawn")
        with open(out_path) as f:
            return json.load(f)
