"""Stages as processes: ipukit on torchrun against hand-written torch.distributed.pipelining.

One ``ipukit-run --nproc 2`` launch of benchmarks/distributed_worker.py times,
interleaved in the same two processes: the balanced 2-stage model as an ipukit
training model on processes, the same stages hand-written with
``PipelineStage`` + ``Schedule1F1B`` (the same schedule), and the ipukit model
on threads in process 0. Ratios are paired per round (fastest call of each
variant in a round), as everywhere in this suite.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from statistics import median

from .common import Sizes, paired_ratio, verdict

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(s: Sizes) -> dict:
    cfg = {"width": s.width, "layers": s.layers_per_stage, "micro_batch": s.micro_batch,
           "micro_batches": s.micro_batches, "rounds": max(4, s.rounds),
           "per_round": max(2, s.steps_per_round // 5)}
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


def distributed(s: Sizes) -> dict:
    from .suite import row

    d = launch(s)
    t, per = d["times"], d["config"]["per_round"]
    # throughput ratio = inverse time ratio
    vs_torch, noise_torch = paired_ratio(t["torch_handwritten"], t["ipukit_processes"], per)
    vs_threads, noise_threads = paired_ratio(t["ipukit_threads"], t["ipukit_processes"], per)
    untimed, noise_untimed = paired_ratio(t["torch_handwritten"], t["ipukit_processes_untimed"],
                                          per)
    # every call's, beside the paired fastest-of-round statistic (a second view of the same run)
    of_medians = median(t["torch_handwritten"]) / median(t["ipukit_processes"])
    samples = d["samples"]
    rate = {k: samples / min(v) for k, v in t.items()}
    d["samples_per_second_best"] = rate
    rows = [
        row("distributed", "2 stages as processes: ipukit ÷ hand-written "
            "torch.distributed.pipelining (Schedule1F1B)", vs_torch, "×", "≥ 0.97",
            verdict(vs_torch, noise_torch, 0.97, below=False),
            f"{rate['ipukit_processes']:.0f} vs {rate['torch_handwritten']:.0f} samples/s "
            f"(best calls); noise ±{noise_torch:.3f}; median calls {of_medians:.3f}; same 2 gloo "
            f"processes, interleaved ({d['config']['rounds']} rounds × {per} calls)"),
        row("distributed", "the same, timeline off: ipukit ÷ hand-written", untimed, "×",
            note=f"{rate['ipukit_processes_untimed']:.0f} samples/s; noise ±{noise_untimed:.3f}; "
            "recordTimeline(False): no spans recorded or gathered to process 0"),
        row("distributed", "2 balanced stages: processes ÷ threads (throughput)", vs_threads,
            "×", None, None,
            f"processes {rate['ipukit_processes']:.0f} vs threads {rate['ipukit_threads']:.0f} "
            f"samples/s (best calls); noise ±{noise_threads:.3f}"),
    ]
    return {"rows": rows, "details": d}
