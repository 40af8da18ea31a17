"""The stall watchdog's cost on a normal call: Options.stallTimeout on (30 s) vs off.

What the watchdog adds to a call on threads: one counter increment per action on each
worker, a read of the counters' sum by the calling thread each time it has waited
50 ms for the workers anyway, and a restart per iteration. Measured on small passes,
where a per-action cost would show most: 4 × Linear(256) + ReLU, micro-batch 8,
gradient accumulation 16, device iterations 2, pipelined over 4 virtual IPUs (threads)
and over 2. The variants are two models of the same weights (copies), called in
alternating rounds (``common.interleaved``); the ratio is the paired fastest-of-round one
(``common.paired_ratio``), with "off ÷ off" (two models both without the watchdog) as the
noise floor of the same method.

    python -m benchmarks.watchdog            # full: 15 rounds × 10 calls per variant
    python -m benchmarks.watchdog --quick    # 4 rounds × 3 calls

Writes benchmarks/watchdog.md (and prints it).
"""
from __future__ import annotations

import copy
import os
import sys
import time
from typing import Dict, List

import torch
import torch.nn as nn

import ipukit

from .common import interleaved, machine, median_ratio, paired_ratio

WIDTH = 256
HERE = os.path.dirname(os.path.abspath(__file__))


class _Net(nn.Module):
    def __init__(self, stages: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.stages = stages

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            with ipukit.Block(f"b{i}", ipu_id=i * self.stages // 4):
                x = torch.relu(layer(x))
                if i == 3:
                    loss = ((x - y) ** 2).mean()
        return x, loss


def _model(net: nn.Module, timeout, ga: int, di: int):
    opts = ipukit.Options().deviceIterations(di).stallTimeout(timeout).recordTimeline(False)
    opts.Training.gradientAccumulation(ga)
    return ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=1e-3))


def counter_cost(n: int = 2_000_000) -> float:
    """Nanoseconds of one ``progress[slot] += 1`` (the watchdog's per-action cost)."""
    progress, slot = [0] * 4, 2
    t = time.perf_counter()
    for _ in range(n):
        progress[slot] += 1
    loop = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n):
        pass
    empty = time.perf_counter() - t
    return max(0.0, loop - empty) / n * 1e9


def measure(stages: int, rounds: int, per_round: int) -> Dict[str, object]:
    mb, ga, di = 8, 16, 2
    torch.manual_seed(0)
    base = _Net(stages)
    x, y = torch.randn(mb * ga * di, WIDTH), torch.randn(mb * ga * di, WIDTH)
    models = {name: _model(copy.deepcopy(base), timeout, ga, di)
              for name, timeout in (("on", 30.0), ("off", None), ("off2", None))}
    calls = {name: (lambda m=m: m(x, y)) for name, m in models.items()}
    for fn in calls.values():  # compile, warm up
        fn()
        fn()
    cpu: Dict[str, List[float]] = {name: [] for name in calls}

    def with_cpu(name):  # each call's CPU time too: other processes' load does not add to it
        def call():
            t = time.process_time()
            calls[name]()
            cpu[name].append(time.process_time() - t)
        return call

    times = interleaved({name: with_cpu(name) for name in calls}, rounds, per_round)
    on_off, noise = paired_ratio(times["on"], times["off"], per_round)
    floor, floor_noise = paired_ratio(times["off2"], times["off"], per_round)
    cpu_ratio, cpu_noise = median_ratio(cpu["on"], cpu["off"])
    cpu_floor, cpu_floor_noise = median_ratio(cpu["off2"], cpu["off"])
    for m in models.values():
        m.destroy()
    return {"stages": stages, "on_ms": min(times["on"]) * 1e3, "off_ms": min(times["off"]) * 1e3,
            "on_off": on_off, "noise": noise, "floor": floor, "floor_noise": floor_noise,
            "cpu_on_off": cpu_ratio, "cpu_noise": cpu_noise, "cpu_floor": cpu_floor,
            "cpu_floor_noise": cpu_floor_noise, "actions": 2 * 4 * ga * di}


def main(argv: List[str]) -> None:
    quick = "--quick" in argv
    rounds, per_round = (4, 3) if quick else (15, 10)
    facts = machine()
    ns = counter_cost()
    results = [measure(stages, rounds, per_round) for stages in (4, 2)]
    lines = [
        "# The stall watchdog's cost (Options.stallTimeout on vs off)", "",
        f"`python -m benchmarks.watchdog{' --quick' if quick else ''}` — {facts['date']}, "
        f"{facts['cores']} cores, torch {facts['torch']}, load average at start "
        f"{', '.join(f'{v:.1f}' for v in facts['loadavg_start'])}.", "",
        "4 × Linear(256) + ReLU, micro-batch 8, gradient accumulation 16, device iterations 2, "
        "pipelined on threads (1F1B), timeline off; three models of the same weights called in "
        f"alternating rounds ({rounds} rounds × {per_round} calls each); ratio = median over "
        "rounds of each round's fastest call (on ÷ off); noise = half the interquartile range "
        "of the round ratios; \"off ÷ off\" is a second model without the watchdog against the "
        "first: the method's own noise floor. CPU: the ratio of the median per-call CPU time "
        "of the process (all its threads), which other processes' load does not add to "
        "(noise: bootstrap, `common.median_ratio`).", "",
        "| virtual IPUs | actions per call | on (best, ms) | off (best, ms) | wall on ÷ off | "
        "wall off ÷ off (floor) | CPU on ÷ off | CPU off ÷ off (floor) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['stages']} | {r['actions']} | {r['on_ms']:.2f} | {r['off_ms']:.2f} | "
                     f"{r['on_off']:.3f} ± {r['noise']:.3f} | "
                     f"{r['floor']:.3f} ± {r['floor_noise']:.3f} | "
                     f"{r['cpu_on_off']:.3f} ± {r['cpu_noise']:.3f} | "
                     f"{r['cpu_floor']:.3f} ± {r['cpu_floor_noise']:.3f} |")
    lines += ["", f"One per-action counter increment (`progress[slot] += 1`, the watchdog's "
                  f"only cost inside a worker's loop, paid with the watchdog on or off): "
                  f"{ns:.0f} ns, i.e. {ns * results[0]['actions'] / 1e3:.0f} µs of a "
                  f"{results[0]['off_ms']:.0f} ms call of {results[0]['actions']} actions. With "
                  "the watchdog on, the calling thread also sums the counters each time it has "
                  "waited 50 ms for the workers.", ""]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(HERE, "watchdog.md"), "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
