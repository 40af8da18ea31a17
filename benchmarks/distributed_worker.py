"""Run under ``ipukit-run --nproc 2`` by benchmarks/distributed.py: one launch, four variants.

* ``ipukit_processes`` — the balanced 2-stage model as an ipukit training model,
  stages as processes (ipukit's 1F1B schedule run by torch's schedule runtime);
* ``torch_handwritten`` — the same stages hand-written with
  torch.distributed.pipelining: a manual ``PipelineStage`` per process,
  ``Schedule1F1B`` (the same order of forwards and backwards), SGD;
* ``ipukit_processes_untimed`` — the first, with ``recordTimeline(False)``: no
  spans recorded or gathered to process 0 (what the timeline costs);
* ``ipukit_threads`` — the same ipukit model on threads in process 0
  (``Options.Distributed.disable()``) while process 1 waits in a barrier.

Variants are interleaved one call at a time (a cycle runs each once, the order
rotated from cycle to cycle, so no variant always follows the same one); every
timed call starts and ends at a barrier, so each time is the slowest
process's. Process 0 writes the times.
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


def ipukit_model(cfg, distributed, record=True, net=None):
    net = net or BalancedNet(balanced_sequential(2, cfg["width"], cfg["layers"]))
    opts = ipukit.Options().pipelineSchedule("1F1B").recordTimeline(record)
    opts.Training.gradientAccumulation(cfg["micro_batches"])
    if not distributed:
        opts.Distributed.disable()
    model = ipd.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))
    return model


def handwritten(cfg, rank, body=None):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    body = body or balanced_sequential(2, cfg["width"], cfg["layers"])
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
    # every variant trains the very same weight tensors, and each launch builds the variants
    # in another order (cfg["order"]): where a variant's tensors land in memory moves its
    # calls by a few per cent (two identical ipukit models differed by up to 4 % in one
    # launch), a bias that averages out over launches and must not favour one variant
    # (each ipukit model wraps its own BalancedNet around the one body: a module is wrapped once)
    body = balanced_sequential(2, cfg["width"], cfg["layers"])

    def processes(record):
        model = ipukit_model(cfg, True, record=record, net=BalancedNet(body))
        return lambda: model(x, y)

    def hand_written():
        schedule, optimizer = handwritten(cfg, rank, body=body)

        def call():
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
            optimizer.step()

        return call

    def threads():
        model = ipukit_model(cfg, False, net=BalancedNet(body)) if rank == 0 else None
        return lambda: model(x, y) if model is not None else None

    build = {"ipukit_processes": lambda: processes(True), "torch_handwritten": hand_written,
             "ipukit_processes_untimed": lambda: processes(False), "ipukit_threads": threads}
    variants = {}
    for name in cfg.get("order", list(build)):  # built and warmed up (compiled) in this order
        variants[name] = build[name]()
        for _ in range(2):
            variants[name]()
            dist.barrier()
    times = {k: [] for k in variants}
    names = list(variants)
    for c in range(cfg["cycles"]):
        k = c % len(names)
        for name in names[k:] + names[:k]:
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
