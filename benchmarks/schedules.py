"""Every pipeline schedule, measured on this machine against its core-limited model.

    .venv/bin/python -m benchmarks.schedules            # → benchmarks/schedules.md / .json
    .venv/bin/python -m benchmarks.schedules --smoke --out /tmp/bench

For P = 2 and 4 virtual IPUs, the balanced model (identical Linear+ReLU
layers, 2 × P × ``layers`` of them) is split the way each schedule wants: one
stage per IPU for GPipe, 1F1B and ZB-H1; two per IPU (a loop, or a V) for
interleaved 1F1B, looped BFS, ZBV and DualPipeV — the same layers and work per
IPU in every case. Each schedule trains ``calls`` steps of ``M`` micro-batches;
the benchmark reports the median measured step time and the step time
ipukit's model gives for that very call on this machine's cores (the call's
own passes, with the contention of sharing the cores taken out by
:func:`benchmarks.common.uncontended_costs`, replayed on
:func:`ipukit.timeline.simulate.available_cores` cores). ``model ÷ measured`` is the
measured utilisation over the modeled one (the same passes in both); the issue's
goal is ≥ 0.9. The winner of each P is the fastest measured schedule.

Each stage's pass costs the *mean* of its measured passes: a step's wall time
is set by the total work, and the mean keeps it (a pass's time has a long
tail — a cold cache, an interrupt — that the median drops: with the median
the model ran 5–15 % faster than the very passes it replays). The median's
ratio is reported beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ipukit  # noqa: E402
from ipukit.timeline.compare import layout  # noqa: E402
from ipukit.schedules import PIPELINED_KINDS  # noqa: E402
from ipukit.timeline.simulate import available_cores  # noqa: E402

from benchmarks.common import model_like  # noqa: E402
from benchmarks.common import uncontended_costs  # noqa: E402

from .models import balanced_data, stage_layers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FULL = {"width": 512, "layers": 2, "micro_batch": 64, "micro_batches": 8, "calls": 12}
SMOKE = {"width": 32, "layers": 1, "micro_batch": 8, "micro_batches": 8, "calls": 2}


class StagedNet(torch.nn.Module):
    """Balanced stages as Blocks ``s0``, ``s1``, ...; the loss in the last one."""

    def __init__(self, stages: List[torch.nn.Module]):
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)

    def forward(self, x, labels):
        for i, stage in enumerate(self.stages):
            with ipukit.Block(f"s{i}"):
                x = stage(x)
                if i == len(self.stages) - 1:
                    loss = F.cross_entropy(x, labels)
        return x, loss


def training_model(kind: str, ipus: int, size: Dict[str, int]) -> ipukit.PoplarExecutor:
    """The balanced model split and placed as ``kind`` wants, on ``ipus`` virtual IPUs."""
    placement = layout(kind, ipus)
    per_stage = 2 * ipus * size["layers"] // len(placement)
    torch.manual_seed(0)
    net = StagedNet([stage_layers(size["width"], per_stage) for _ in placement])
    opts = ipukit.Options().pipelineSchedule(PIPELINED_KINDS[kind])
    opts.Training.gradientAccumulation(size["micro_batches"])
    opts.setExecutionStrategy(ipukit.PipelinedExecution(
        *[ipukit.Stage(f"s{s}").ipu(i) for s, i in enumerate(placement)]))
    return ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))


def measure(kind: str, ipus: int, size: Dict[str, int]) -> Dict[str, float]:
    model = training_model(kind, ipus, size)
    x, y = balanced_data(size["width"], size["micro_batch"] * size["micro_batches"])
    model(x, y)  # compile and warm up
    times: List[float] = []
    ratios: Dict[str, List[float]] = {"mean": [], "median": []}
    for _ in range(size["calls"]):
        start = time.perf_counter()
        model(x, y)
        times.append(time.perf_counter() - start)
        measured = model.getTimeline()
        for statistic, out in ratios.items():
            modeled = model_like(measured, cores=available_cores(),
                                 costs=uncontended_costs(measured, statistic=statistic))
            out.append(modeled.wall_time / measured.wall_time)
    model.destroy()
    return {"step_ms": statistics.median(times) * 1e3,
            "model_over_measured": statistics.median(ratios["mean"]),
            "model_over_measured_median_costs": statistics.median(ratios["median"])}


def run(size: Dict[str, int]) -> Dict[str, object]:
    load_before = os.getloadavg()[0]
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    for ipus in (2, 4):
        results[str(ipus)] = {kind: measure(kind, ipus, size) for kind in PIPELINED_KINDS}
    winners = {p: min(r, key=lambda k: r[k]["step_ms"]) for p, r in results.items()}
    return {"size": size, "cores": available_cores(), "torch": torch.__version__,
            "load": [load_before, os.getloadavg()[0]], "results": results, "winners": winners}


def markdown(data: Dict[str, object]) -> str:
    lines = ["# Pipeline schedules on this machine", "",
             f"Balanced model, width {data['size']['width']}, "
             f"{data['size']['micro_batches']} micro-batches of {data['size']['micro_batch']}, "
             f"{data['cores']} cores, torch {data['torch']}, load "
             f"{data['load'][0]:.1f} → {data['load'][1]:.1f}. "
             "`model ÷ measured`: the core-limited model's step time over the measured one "
             "(goal ≥ 0.9), each stage's passes costing their mean (the call's own work); "
             "beside it, with their median (see the module docstring). "
             "Generated by `python -m benchmarks.schedules`.", ""]
    for ipus, rows in data["results"].items():
        lines += [f"## {ipus} virtual IPUs — fastest: {PIPELINED_KINDS[data['winners'][ipus]]}",
                  "", "| schedule | step (ms) | model ÷ measured | with median costs |",
                  "|---|---:|---:|---:|"]
        for kind, r in rows.items():
            lines.append(f"| {PIPELINED_KINDS[kind]} | {r['step_ms']:.1f} | "
                         f"{r['model_over_measured']:.2f} | "
                         f"{r['model_over_measured_median_costs']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.schedules")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke and args.out is None:
        p.error("--smoke writes to a scratch folder: give --out DIR")
    data = run(SMOKE if args.smoke else FULL)
    out = args.out or HERE
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "schedules.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out, "schedules.md"), "w") as f:
        f.write(markdown(data) + "\n")
    print(markdown(data))


if __name__ == "__main__":
    main()
