"""On a CUDA machine: ipukit on one GPU against plain PyTorch (step time), CUDA-event spans.

    python -m benchmarks.gpu_check        # prints a few lines; nothing is written
"""
from __future__ import annotations

import time

import torch

import ipukit

from .models import BalancedNet, balanced_data, balanced_sequential


def _best(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA here")
    width, stages, mb, ga = 1024, 4, 64, 8
    x, y = balanced_data(width, mb * ga)
    for record in (True, False):
        net = BalancedNet(balanced_sequential(stages, width, 2))
        plain = BalancedNet(balanced_sequential(stages, width, 2)).cuda()
        opt = torch.optim.SGD(plain.parameters(), lr=0.01)
        xs, ys = x.cuda().split(mb), y.cuda().split(mb)

        def loop():
            opt.zero_grad(set_to_none=True)
            for k in range(ga):
                (plain(xs[k], ys[k])[1] / ga).backward()
            opt.step()

        for sharded in (True, False):
            opts = ipukit.Options().deviceMapping(["cuda:0"]).recordTimeline(record)
            opts.Training.gradientAccumulation(ga)
            if sharded:
                opts.setExecutionStrategy(ipukit.ShardedExecution(ipukit.AutoStage.SameAsIpu))
            model = BalancedNet(balanced_sequential(stages, width, 2))
            tm = ipukit.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
            t_ipu, t_loop = _best(lambda: tm(x, y)), _best(loop)
            print(f"{torch.cuda.get_device_name()} {stages} stages on one GPU, "
                  f"{'sharded' if sharded else 'pipelined'}, record={record}: ipukit "
                  f"{t_ipu * 1e3:.2f} ms vs plain loop {t_loop * 1e3:.2f} ms per step "
                  f"(loop ÷ ipukit speed {t_loop / t_ipu:.2f})")
        del net


if __name__ == "__main__":
    main()
