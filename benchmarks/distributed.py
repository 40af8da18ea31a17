"""Stages as processes: ipukit on torchrun against hand-written torch.distributed.pipelining.

Each ``ipukit-run --nproc 2`` launch of benchmarks/distributed_worker.py times,
interleaved in the same two processes: the balanced 2-stage model as an ipukit
training model on processes (timeline on, and off), the same stages
hand-written with ``PipelineStage`` + ``Schedule1F1B`` (the same schedule), and
the ipukit model on threads in process 0, all training the same weight tensors.

Two kinds of noise, measured here and handled separately:

* a single call's time varies by about ±30 % (two processes, their
  communication threads and other work on two cores), far more than the few
  per cent sought: the variants alternate one call at a time over many cycles,
  and a launch's ratio is that of their median calls
  (:func:`~benchmarks.common.median_ratio`);
* a launch's ratios move by a few per cent from launch to launch with where
  each variant's tensors land in memory (two identical ipukit models in one
  launch differed by up to 4 %): launches build the variants in rotated
  orders, the value is the mean of their ratios and the noise at least half
  their range.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from statistics import median

import torch

from .common import Sizes, Unavailable, median_ratio, paired_ratio, verdict

HERE = os.path.dirname(os.path.abspath(__file__))


VARIANTS = ["ipukit_processes", "torch_handwritten", "ipukit_processes_untimed", "ipukit_threads"]


def launch(s: Sizes, order: list) -> dict:
    cfg = {"width": s.width, "layers": s.layers_per_stage, "micro_batch": s.micro_batch,
           "micro_batches": s.micro_batches, "order": order,
           "cycles": max(8, s.rounds * s.steps_per_round // 3)}
    with tempfile.TemporaryDirectory(prefix="ipukit-bench-") as tmp:
        cfg_path, out_path = os.path.join(tmp, "cfg.json"), os.path.join(tmp, "out.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # a CPU (gloo) comparison everywhere
        env.pop("RANK", None), env.pop("WORLD_SIZE", None)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, "-m", "ipukit.distributed.run", "--nproc", "2",
                               os.path.join(HERE, "distributed_worker.py"), cfg_path, out_path],
                              env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "ipukit-run:" in ln]
            raise RuntimeError(f"ipukit-run failed: {lines[-1] if lines else proc.returncode}")
        with open(out_path) as f:
            out = json.load(f)
    out["config"] = cfg
    return out


def _over_launches(runs: list, a: str, b: str) -> tuple:
    """(mean ratio, noise, per-launch ratios) of variant ``a`` ÷ ``b`` (time ratios)."""
    pairs = [median_ratio(d["times"][a], d["times"][b]) for d in runs]
    ratios = [r for r, _ in pairs]
    spread = (max(ratios) - min(ratios)) / 2
    within = sum(n for _, n in pairs) / len(pairs)
    noise = max(spread, within) if within == within else spread
    return sum(ratios) / len(ratios), noise, ratios


def distributed(s: Sizes) -> dict:
    from ipukit.runtime.processes.group import PROCESS_RUNTIME_TORCH, torch_release

    from .suite import row

    if torch_release() < PROCESS_RUNTIME_TORCH:
        raise Unavailable(f"ipukit's process runtime needs torch "
                          f"{'.'.join(map(str, PROCESS_RUNTIME_TORCH))} or later; this is torch "
                          f"{torch.__version__}")

    runs = [launch(s, VARIANTS[k:] + VARIANTS[:k]) for k in range(s.distributed_launches)]
    # throughput ratio = inverse time ratio
    vs_torch, noise_torch, each = _over_launches(runs, "torch_handwritten", "ipukit_processes")
    vs_threads, noise_threads, _ = _over_launches(runs, "ipukit_threads", "ipukit_processes")
    untimed, noise_untimed, each_untimed = _over_launches(runs, "torch_handwritten",
                                                          "ipukit_processes_untimed")
    # a second view: the suite's paired fastest-of-round, rounds of 5 cycles, every launch
    fastest = median([paired_ratio(d["times"]["torch_handwritten"],
                                   d["times"]["ipukit_processes"], 5)[0] for d in runs])
    samples = runs[0]["samples"]
    rate = {k: samples / median([t for d in runs for t in d["times"][k]]) for k in VARIANTS}
    cycles = runs[0]["config"]["cycles"]
    d = {"launches": runs, "samples_per_second_median": rate,
         "ratios_per_launch": {"vs_handwritten": each, "untimed_vs_handwritten": each_untimed}}
    listed = ", ".join(f"{r:.3f}" for r in each)
    rows = [
        row("distributed", "2 stages as processes: ipukit ÷ hand-written "
            "torch.distributed.pipelining (Schedule1F1B)", vs_torch, "×", "≥ 0.97",
            verdict(vs_torch, noise_torch, 0.97, below=False),
            f"{rate['ipukit_processes']:.0f} vs {rate['torch_handwritten']:.0f} samples/s "
            f"(median calls); noise ±{noise_torch:.3f}; launches {listed} (each building the "
            f"variants in another order, {cycles} cycles of one call per variant); "
            f"fastest-of-round {fastest:.3f}; same 2 gloo processes"),
        row("distributed", "the same, timeline off: ipukit ÷ hand-written", untimed, "×",
            note=f"{rate['ipukit_processes_untimed']:.0f} samples/s (median calls); noise "
            f"±{noise_untimed:.3f}; launches " + ", ".join(f"{r:.3f}" for r in each_untimed) + "; "
            "recordTimeline(False): no spans recorded or gathered to process 0"),
        row("distributed", "2 balanced stages: processes ÷ threads (throughput)", vs_threads,
            "×", None, None,
            f"processes {rate['ipukit_processes']:.0f} vs threads {rate['ipukit_threads']:.0f} "
            f"samples/s (median calls); noise ±{noise_threads:.3f}"),
    ]
    return {"rows": rows, "details": d}
