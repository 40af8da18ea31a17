"""Run under ``ipukit-run --nproc 2`` by benchmarks/distributed.py: one launch, three variants.

* ``ipukit_processes`` — the balanced 2-stage model as an ipukit training model,
  stages as processes (ipukit's 1F1B schedule run by torch's schedule runtime);
* ``torch_handwritten`` — the same stages hand-written with
  torch.distributed.pipelining: a manual ``PipelineStage`` per process,
  ``Schedule1F1B`` (the same order of forwards and backwards), SGD;
* ``ipukit_processes_untimed`` — the first, with ``recordTimeline(False)``: no
  spans recorded or gathered to process 0 (what the timeline costs);
* ``ipukit_threads`` — the same ipukit model on threads in process 0
  (``Options.Distributed.disable()``) while process 1 waits in a barrier.

Variants are interleaved round by round; every timed call starts and ends at a
barrier, so each time is the slowest process's. Process 0 writes the times.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ipukit
import ipukit.distributed as ipd
from benchmarks.models import BalancedNet, balanced_data, balanced_sequential


def ipukit_model(cfg, distributed, record=True):
    net = BalancedNet(balanced_sequential(2, cfg["width"], cfg["layers"]))
    opts = ipukit.Options().pipelineSchedule("1F1B").recordTimeline(record)
    opts.Training.gradientAccumulation(cfg["micro_batches"])
    if not distributed:
        opts.Distributed.disable()
    model = ipd.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))
    return model


def handwritten(cfg, rank):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    body = balanced_sequential(2, cfg["width"], cfg["layers"])
    module = body[rank]
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=cfg["micro_batches"],
                            loss_fn=F.cross_entropy, scale_grads=True)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    return schedule, optimizer


def main(cfg_path, out_path):
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")  # the hand-written pipeline needs it before ipukit's first call
    x, y = balanced_data(cfg["width"], cfg["micro_batch"] * cfg["micro_batches"])
    procs = ipukit_model(cfg, True)
    untimed = ipukit_model(cfg, True, record=False)
    schedule, optimizer = handwritten(cfg, rank)
    threads = ipukit_model(cfg, False) if rank == 0 else None

    def run_processes():
        procs(x, y)

    def run_untimed():
        untimed(x, y)

    def run_handwritten():
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()

    def run_threads():
        if rank == 0:
            threads(x, y)

    variants = {"ipukit_processes": run_processes, "torch_handwritten": run_handwritten,
                "ipukit_processes_untimed": run_untimed, "ipukit_threads": run_threads}
    times = {k: [] for k in variants}
    for fn in variants.values():  # warm up (compile, first-call set-up)
        for _ in range(2):
            fn()
            dist.barrier()
    order = list(variants)
    for r in range(cfg["rounds"]):
        for name in (order if r % 2 == 0 else order[::-1]):
            for _ in range(cfg["per_round"]):
                dist.barrier()
                t = time.perf_counter()
                variants[name]()
                dist.barrier()
                times[name].append(time.perf_counter() - t)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "samples": x.shape[0]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
