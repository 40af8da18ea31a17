"""A pass handed between cores: why a pipeline's passes run slower than the same passes
on one worker.

``python -m benchmarks.cross_core`` (``benchmarks/cross_core.md``). The calibration table
(``benchmarks/calibration.md``) models every pipelined row faster than measured (pooled
over seven runs, 0.82-0.93), and the critical-path split puts most of that in the passes.
This benchmark runs the same two stages (the convnet's and the ViT's halves, as ipukit
compiles them, micro-batch 40 and 32), one micro-batch at a time in strict turn, so no
two passes ever run at once (no contention, no interpreter lock shared by two passes),
in four ways, the ways in turn each round:

- **one thread**: one thread runs F0, F1, B1, B0 (as the calibration's one-worker run);
- **two threads, two cores**: stage 0's passes on one thread, stage 1's on another, each
  hand-off through a queue, the threads left to the OS as ipukit leaves a pipeline of no
  more workers than cores (each thread idles while the other works);
- **two threads, one core**: the same, both threads pinned to one core (the core never
  idles; the hand-offs stay on it);
- **one thread, idle between**: one thread pinned to one core, sleeping before F1 and
  before B0 as long as the other stage's typical passes (the core idles as a pipeline's
  worker's does, and no tensor changes core).

Each thread has one intra-op thread, as a worker of a 2-worker pipeline on 2 cores. Each
pass's median over the rounds, and its ratio to the one-thread pass, is reported. Plain
PyTorch apart from the stage modules: the queue hand-off is a few microseconds and lies
outside the passes' spans.
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from typing import Callable, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ipukit  # noqa: E402

from .calibration import setup  # noqa: E402
from .common import machine, write_result  # noqa: E402

MODES = ("one thread", "two threads, two cores", "two threads, one core",
         "one thread, idle between")
PASSES = ("F0", "F1", "B1", "B0")


def _stages(name: str, micro_batches: int):
    """The model's two stages as ipukit compiles them, their loss, and micro-batches."""
    net, (x, y), blocks, _ = setup(name, 8, 2)
    half = (len(blocks) + 1) // 2
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(micro_batches)
    opts.setExecutionStrategy(ipukit.ShardedExecution(ipukit.Stage(*blocks[:half]).ipu(0),
                                                      ipukit.Stage(*blocks[half:]).ipu(1)))
    model = ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.0))
    n = x.shape[0] * micro_batches
    model(x.repeat(micro_batches, 1, 1, 1), y.repeat(micro_batches))  # compile
    program = model.program
    first, second = (st.module for st in program.partition.stages)
    data = [(x.clone(), y.clone()) for _ in range(micro_batches)]
    return model, first, second, program.loss_of, data, n


class _Run:
    """One way of running the passes of ``data``, recording each pass's seconds."""

    def __init__(self, first, second, loss_of, data, times: Dict[str, List[float]]):
        self.first, self.second, self.loss_of, self.data, self.times = (
            first, second, loss_of, data, times)

    def _timed(self, key: str, fn: Callable[[], object]):
        t = time.perf_counter()
        out = fn()
        self.times[key].append(time.perf_counter() - t)
        return out

    def f0(self, x):
        h = self._timed("F0", lambda: self.first(x))
        return h, h.detach().requires_grad_()

    def f1b1(self, received, y):
        outs = self._timed("F1", lambda: self.second(received, y))
        self._timed("B1", lambda: torch.autograd.backward(self.loss_of(outs)))
        return received.grad

    def b0(self, h, g):
        self._timed("B0", lambda: torch.autograd.backward(h, g))

    def one_thread(self, idle: float = 0.0) -> None:
        wait = threading.Event()
        for x, y in self.data:
            h, received = self.f0(x)
            if idle:
                wait.wait(idle)
            g = self.f1b1(received, y)
            if idle:
                wait.wait(idle)
            self.b0(h, g)

    def two_threads(self, cores) -> None:
        to_second: "queue.Queue" = queue.Queue()
        to_first: "queue.Queue" = queue.Queue()
        failed: List[BaseException] = []

        def stage0() -> None:
            try:
                _pin(cores[0])
                for x, _ in self.data:
                    h, received = self.f0(x)
                    to_second.put(received)
                    self.b0(h, to_first.get())
            except BaseException as exc:   # raised again on the calling thread
                failed.append(exc)
                to_second.put(None)

        def stage1() -> None:
            try:
                _pin(cores[1])
                for _, y in self.data:
                    received = to_second.get()
                    if received is None:
                        return
                    to_first.put(self.f1b1(received, y))
            except BaseException as exc:
                failed.append(exc)
                to_first.put(None)

        _join([stage0, stage1])
        if failed:
            raise failed[0]


def _pin(core) -> None:
    torch.set_num_threads(1)
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def _join(targets) -> None:
    threads = [threading.Thread(target=t, daemon=True, name=f"cross-core-{i}")
               for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(models=("convnet", "vit"), rounds: int = 15, micro_batches: int = 8) -> Dict:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    out = {"rounds": rounds, "micro_batches": micro_batches, "cores": len(cores),
           "machine": machine(), "models": {}}
    for name in models:
        model, first, second, loss_of, data, _ = _stages(name, micro_batches)
        try:
            times = {m: {p: [] for p in PASSES} for m in MODES}
            with torch.enable_grad():
                # warm-up, and the other stage's typical passes for the idle way
                warm = {p: [] for p in PASSES}
                _one(first, second, loss_of, data, warm, None)
                idle = statistics.median(warm["F1"]) + statistics.median(warm["B1"])
                for r in range(rounds):
                    for i in range(len(MODES)):
                        mode = MODES[(i + r) % len(MODES)]   # each way first in turn
                        run = _Run(first, second, loss_of, data, times[mode])
                        if mode == "one thread":
                            _one(first, second, loss_of, data, times[mode], None)
                        elif mode == "one thread, idle between":
                            _one(first, second, loss_of, data, times[mode], cores[0], idle)
                        elif mode == "two threads, two cores":
                            run.two_threads((None, None))
                        else:
                            run.two_threads((cores[0], cores[0]))
                    for p in list(first.parameters()) + list(second.parameters()):
                        p.grad = None
        finally:
            model.destroy()
        medians = {m: {p: statistics.median(v) for p, v in t.items()} for m, t in times.items()}
        out["models"][name] = {
            "pass_ms": {m: {p: v * 1e3 for p, v in d.items()} for m, d in medians.items()},
            "ratio": {m: {p: medians[m][p] / medians["one thread"][p] for p in PASSES}
                      for m in MODES},
            "idle_ms": idle * 1e3}
    return out


def _one(first, second, loss_of, data, times, core, idle: float = 0.0) -> None:
    """One thread (pinned to ``core`` where given) running every pass in turn."""
    failed: List[BaseException] = []

    def work() -> None:
        try:
            _pin(core)
            _Run(first, second, loss_of, data, times).one_thread(idle)
        except BaseException as exc:
            failed.append(exc)

    _join([work])
    if failed:
        raise failed[0]


def report(result: Dict) -> str:
    lines = [f"# A pass handed between cores (two stages, one micro-batch at a time in "
             f"strict turn; medians of {result['rounds']} rounds × "
             f"{result['micro_batches']} micro-batches, the ways in turn; "
             f"{result['cores']} cores, one intra-op thread per thread, torch "
             f"{result['machine']['torch']})", ""]
    for name, got in result["models"].items():
        lines += [f"## {name} (the other stage's passes, slept in the idle way: "
                  f"{got['idle_ms']:.2f} ms)", "",
                  "| way | " + " | ".join(f"{p} (ms)" for p in PASSES) + " | "
                  + " | ".join(f"{p} ÷ one thread" for p in PASSES) + " |",
                  "|---|" + "---|" * (2 * len(PASSES))]
        for m in MODES:
            lines.append(f"| {m} | " + " | ".join(f"{got['pass_ms'][m][p]:.3f}" for p in PASSES)
                         + " | " + " | ".join(f"{got['ratio'][m][p]:.2f}" for p in PASSES)
                         + " |")
        lines.append("")
    lines += ["No two passes ever run at once here: what the two-core way adds over one "
              "thread is the hand-off between cores and each core idling while the other "
              "works. The one-core way keeps the hand-offs but never idles the core and "
              "never moves a tensor; the idle way idles the core and moves nothing.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    if args.smoke and os.path.abspath(args.out) == HERE:
        ap.error("--smoke needs --out (it never writes over the recorded results)")
    result = (measure(models=("convnet",), rounds=1, micro_batches=2) if args.smoke
              else measure(rounds=args.rounds))
    write_result(args.out, "cross_core", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
