"""The benchmarks. Each returns ``{"rows": [...], "details": {...}}``.

A row is one number for the results table, with its goal when it has one;
details keep everything else (raw medians, per-stage costs) for results.json.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

import ipukit
from ipukit.timeline import Timeline

from . import peers
from .common import (BATCH, Sizes, cores, interleaved, median, paired_ratio, threads, timed,
                     verdict)
from .models import (PlainStep, balanced_data, balanced_ipukit, tiny_pair, tutorial_data,
                     tutorial_pipelined, tutorial_single_stage)


def row(section: str, metric: str, value: float, unit: str = "", goal: Optional[str] = None,
        met: Optional[bool] = None, note: str = "") -> dict:
    return {"section": section, "metric": metric, "value": value, "unit": unit, "goal": goal,
            "met": met, "note": note}


def host_seconds(tl: Timeline) -> float:
    """Host-track time of a call: splitting inputs before the run, gathering outputs after."""
    return sum(e.duration for e in tl.events if e.ipu < 0 and e.kind == "host")


# -- 1. overhead -----------------------------------------------------------------
# Host-cost benchmarks run both variants with one intra-op thread: ipukit's
# host work does not depend on it, and one thread avoids OpenMP barrier stalls
# that swamp the measurement when other processes share the cores.
HOST_THREADS = 1


def overhead(s: Sizes) -> dict:
    """ipukit's single-stage step ÷ a hand-written PyTorch step, tutorial model, batch 40."""
    with threads(HOST_THREADS):
        one, ten = _tutorial_overhead(s)
        fixed = _fixed_overhead(s)
    rows = [row("overhead", "single-stage step ÷ plain PyTorch step (DI 1)", one["ratio"], "×",
                "≤ 1.03", verdict(one["ratio"], one["noise"], 1.03),
                f"{one['ipukit'] * 1e3:.2f} ms vs {one['plain'] * 1e3:.2f} ms; noise "
                f"±{one['noise']:.3f}; timeline host "
                f"spans {one['host'] * 1e3:.2f} ms/call; {HOST_THREADS} thread"),
            row("overhead", "single-stage step ÷ plain PyTorch step (DI 10)", ten["ratio"], "×",
                "≤ 1.03", verdict(ten["ratio"], ten["noise"], 1.03),
                f"{ten['ipukit'] * 1e2:.2f} ms vs {ten['plain'] * 1e2:.2f} ms per step; "
                f"noise ±{ten['noise']:.3f}"),
            row("overhead", "fixed cost per call (4×4 linear model)", fixed["extra"] * 1e6, "µs",
                note=f"ipukit {fixed['ipukit'] * 1e6:.0f} µs vs plain {fixed['plain'] * 1e6:.0f} µs"
                f"; without recording {fixed['ipukit_norec'] * 1e6:.0f} µs")]
    return {"rows": rows, "details": {"tutorial_di1": one, "tutorial_di10": ten, "tiny": fixed,
                                      "threads": HOST_THREADS}}


def _pair(variants: Dict[str, Callable], a: str, b: str, rounds: int, per_round: int) -> dict:
    """Warm both, time them interleaved; medians and the paired ratio of ``a`` ÷ ``b``."""
    for fn in variants.values():
        fn()
    t = interleaved(variants, rounds, per_round)
    out = {k: median(v) for k, v in t.items()}
    out["ratio"], out["noise"] = paired_ratio(t[a], t[b], per_round)
    return out


def _tutorial_overhead(s: Sizes):
    x, y = tutorial_data(BATCH * 10)
    x1, y1 = x[:BATCH], y[:BATCH]
    chunks = list(zip(x.chunk(10), y.chunk(10)))
    one_model, ten_model, plain = tutorial_single_stage(1), tutorial_single_stage(10), PlainStep()
    one = _pair({"ipukit": lambda: one_model(x1, y1), "plain": lambda: plain(x1, y1)},
                "ipukit", "plain", s.rounds, s.steps_per_round)
    one["host"] = host_seconds(one_model.getTimeline())
    ten = _pair({"ipukit": lambda: ten_model(x, y),
                 "plain": lambda: [plain(a, b) for a, b in chunks]},
                "ipukit", "plain", s.rounds, max(1, s.steps_per_round // 5))
    return one, ten


def _fixed_overhead(s: Sizes) -> dict:
    """Per-call cost ipukit adds when the model's compute is negligible."""
    x, y = torch.randn(BATCH, 4), torch.randint(0, 4, (BATCH,))
    model, plain = tiny_pair()
    norec, _ = tiny_pair(record=False)
    out = _pair({"ipukit": lambda: model(x, y), "ipukit_norec": lambda: norec(x, y),
                 "plain": lambda: plain(x, y)}, "ipukit", "plain", s.rounds,
                s.steps_per_round * 10)
    out["extra"] = out["ipukit"] - out["plain"]
    return out


# -- 2. pipeline efficiency --------------------------------------------------------
def utilisation_ratios(model, tl: Timeline) -> Dict[str, float]:
    """Measured utilisation beside the schedule model's, fed this call's own stage costs."""
    sched = model._schedule
    modeled = ipukit.simulate(sched.kind, sched.num_stages, sched.micro_batches,
                              **ipukit.costs_from(tl), schedule=sched)
    measured = tl.utilisation()["overall"]
    devices_only = Timeline(tl.device_events()).utilisation()["overall"]
    ideal = modeled.utilisation()["overall"]
    return {"measured": measured, "measured_devices_only": devices_only, "modeled": ideal,
            "ratio": measured / ideal, "ratio_devices_only": devices_only / ideal}


def _pipeline_for(s: Sizes, n: int) -> dict:
    x, y = balanced_data(s.width, s.micro_batch * s.micro_batches)
    pipe = balanced_ipukit(n, s.width, s.layers_per_stage, s.micro_batches)
    shard = balanced_ipukit(n, s.width, s.layers_per_stage, s.micro_batches, sharded=True)
    timelines: List[Timeline] = []

    def run_pipe():
        pipe(x, y)
        timelines.append(pipe.getTimeline())

    pipe(x, y), shard(x, y)
    t = interleaved({"pipelined": run_pipe, "sharded": lambda: shard(x, y)},
                    max(1, s.pipeline_calls // 2), 2)
    ratios = [utilisation_ratios(pipe, tl) for tl in timelines]
    summary = {k: median([r[k] for r in ratios]) for k in ratios[0]}
    samples = x.shape[0]
    summary["pipelined_samples_s"] = samples / median(t["pipelined"])
    summary["sharded_samples_s"] = samples / median(t["sharded"])
    summary["stage_costs"] = timelines[-1].stage_costs()
    return summary


def pipeline(s: Sizes) -> dict:
    """Balanced N-stage model: pipelined vs sharded, and measured vs modeled utilisation."""
    rows, details = [], {}
    for n in s.stage_counts:
        d = details[f"{n}_stages"] = _pipeline_for(s, n)
        speedup = d["pipelined_samples_s"] / d["sharded_samples_s"]
        goal = "≥ 0.9" if n == 2 else None
        rows += [
            row("pipeline", f"{n} stages: measured ÷ modeled utilisation", d["ratio"], "×", goal,
                d["ratio"] >= 0.9 if goal else None,
                f"measured {d['measured']:.1%}, modeled {d['modeled']:.1%}; devices only "
                f"{d['measured_devices_only']:.1%} (ratio {d['ratio_devices_only']:.3f})"),
            row("pipeline", f"{n} stages: pipelined ÷ sharded throughput", speedup, "×", None,
                None, f"{d['pipelined_samples_s']:.0f} vs {d['sharded_samples_s']:.0f} samples/s"
                f" on {cores()} cores (sharded uses every core per op)")]
    return {"rows": rows, "details": details}


# -- 3. peers ------------------------------------------------------------------------
def _peer_in_process(s: Sizes, n: int) -> Dict[str, float]:
    """ipukit (GPipe and 1F1B schedules) and torchgpipe, interleaved in this process."""
    x, y = balanced_data(s.width, s.micro_batch * s.micro_batches)
    args = (n, s.width, s.layers_per_stage, s.micro_batches)
    gpipe = balanced_ipukit(*args, schedule="GPipe")
    f1b1 = balanced_ipukit(*args, schedule="1F1B")
    tg = peers.torchgpipe_step(n, s.width, s.layers_per_stage, s.micro_batch, s.micro_batches)
    variants = {"ipukit_gpipe": lambda: gpipe(x, y), "ipukit_1f1b": lambda: f1b1(x, y),
                "torchgpipe": tg}
    for fn in variants.values():
        fn()
    t = interleaved(variants, max(1, s.pipeline_calls // 2), 2)
    return {k: x.shape[0] / median(v) for k, v in t.items()}


def peer_comparison(s: Sizes) -> dict:
    """ipukit ÷ torchgpipe and ÷ torch.distributed.pipelining, same model and micro-batches."""
    rows, details = [], {}
    for n in s.stage_counts:
        d = _peer_in_process(s, n)
        threads = max(1, cores() // n)
        times = peers.torch_pipelining_times(n, s.width, s.layers_per_stage, s.micro_batch,
                                             s.micro_batches, reps=s.pipeline_calls,
                                             threads=threads)
        d["torch_pipelining"] = s.micro_batch * s.micro_batches / median(times)
        details[f"{n}_stages"] = d
        for peer, label in (("torchgpipe", "torchgpipe 0.0.7 GPipe"),
                            ("torch_pipelining", "torch.distributed.pipelining ScheduleGPipe")):
            rows.append(row("peers", f"{n} stages: ipukit GPipe ÷ {label}",
                            d["ipukit_gpipe"] / d[peer], "×", None, None,
                            f"{d['ipukit_gpipe']:.0f} vs {d[peer]:.0f} samples/s "
                            f"(ipukit 1F1B {d['ipukit_1f1b']:.0f})"))
    return {"rows": rows, "details": details}


# -- 4. device iterations --------------------------------------------------------------
def _samples_per_second(model, x, y, calls: int) -> float:
    model.compile(x, y)
    return x.shape[0] * calls / sum(timed(lambda: model(x, y), calls))


def device_iterations(s: Sizes) -> dict:
    """Samples/s at batch 40 as device iterations amortise each call's host work."""
    rows, details = [], {}
    for label, factory, ga in (("tutorial 4-stage pipelined", tutorial_pipelined, s.tutorial_ga),
                               ("single stage", None, 1)):
        for di in s.device_iterations:
            per_call = BATCH * di * ga
            calls = max(1, round(s.di_samples / per_call))
            model = factory(ga, di) if factory else tutorial_single_stage(di)
            x, y = tutorial_data(per_call)
            rate = _samples_per_second(model, x, y, calls)
            details[f"{label} DI {di}"] = {"samples_s": rate, "calls": calls, "ga": ga}
            rows.append(row("device iterations", f"{label}, GA {ga}, DI {di}", rate, "samples/s",
                            note=f"{calls} call(s) of {per_call} samples"))
    return {"rows": rows, "details": details}


# -- 5. timeline recording -----------------------------------------------------------------
def _rebuild_cost(tl: Timeline, reps: int = 20) -> float:
    """Seconds to create this call's events and timeline again: recording's direct cost."""
    fields = [tuple(e) for e in tl.events]
    Event = ipukit.Event

    def rebuild():
        events = [Event(*f) for f in fields]
        Timeline(sorted(events, key=lambda e: (e.start, e.ipu)), meta={})

    return median(timed(rebuild, reps))


def recording(s: Sizes) -> dict:
    """Step time with the timeline recorded vs not, interleaved (A/B) and directly estimated."""
    rows, details = [], {}
    cases = (("single stage, DI 1", lambda rec: tutorial_single_stage(1, record=rec), BATCH,
              s.steps_per_round),
             (f"tutorial 4-stage pipelined, GA {s.tutorial_ga}",
              lambda rec: tutorial_pipelined(s.tutorial_ga, record=rec), BATCH * s.tutorial_ga,
              max(1, s.steps_per_round // 4)))
    with threads(HOST_THREADS):
        for label, make, n, per_round in cases:
            x, y = tutorial_data(n)
            on, off = make(True), make(False)
            d = _pair({"on": lambda: on(x, y), "off": lambda: off(x, y)}, "on", "off",
                      s.rounds, per_round)
            d["ab_cost"] = d["ratio"] - 1.0
            d["direct_cost"] = _rebuild_cost(on.getTimeline()) / d["off"]
            d["events"] = len(on.getTimeline().events)
            details[label] = d
            rows.append(row("recording", f"{label}: recording cost (A/B)", d["ab_cost"] * 100,
                            "% of a step", "≤ 2 %", verdict(d["ab_cost"], d["noise"], 0.02),
                            f"noise ±{d['noise']:.1%}; direct estimate {d['direct_cost']:.2%} "
                            f"({d['events']} events); "
                            f"{HOST_THREADS} thread"))
    return {"rows": rows, "details": details}


# -- 6. schedule model speed ------------------------------------------------------------------
def simulate_speed(s: Sizes) -> dict:
    """Time to model one call of a 16-stage 1F1B pipeline (the explorer's largest case)."""
    m = s.simulate_micro_batches
    t = timed(lambda: ipukit.simulate("1f1b", 16, m), 5 if m >= 1024 else 2)
    events = 16 * m * 2 + 16
    return {"rows": [row("schedule model", f"simulate('1f1b', 16, {m})", median(t) * 1e3, "ms",
                         note=f"{events} actions")],
            "details": {"median_s": median(t), "all_s": t}}


# -- 7. trace and partition ----------------------------------------------------------------------
def compile_time(s: Sizes) -> dict:
    """Trace, split and schedule the tutorial model: the cost of the first call."""
    x, y = tutorial_data(BATCH * s.tutorial_ga)
    pipelined = timed(lambda: tutorial_pipelined(s.tutorial_ga).compile(x, y), s.compile_reps)
    single = timed(lambda: tutorial_single_stage(1).compile(x[:BATCH], y[:BATCH]), s.compile_reps)
    return {"rows": [row("compile", "tutorial model, 4 stages: trace + partition",
                         median(pipelined) * 1e3, "ms"),
                     row("compile", "tutorial model, 1 stage: trace (runs eagerly)",
                         median(single) * 1e3, "ms")],
            "details": {"pipelined_s": pipelined, "single_s": single}}


# -- 8. the tutorial model's stage imbalance ---------------------------------------------------------
def imbalance(s: Sizes) -> dict:
    """Per-block costs from a sharded run, and what they allow a 4-IPU pipeline to gain."""
    ga = s.tutorial_ga
    x, y = tutorial_data(BATCH * ga)
    shard, pipe = tutorial_pipelined(ga, sharded=True), tutorial_pipelined(ga)
    shard(x, y), pipe(x, y)
    t = interleaved({"sharded": lambda: shard(x, y), "pipelined": lambda: pipe(x, y)},
                    max(1, s.rounds // 3), 2)
    costs = shard.getTimeline().stage_costs()
    per_stage = [f + b for f, b in zip(costs["forward"], costs["backward"])]
    balance = statistics.mean(per_stage) / max(per_stage)
    kw = {"forward_cost": costs["forward"], "backward_cost": costs["backward"]}
    ideal = (ipukit.simulate("sharded", 4, ga, **kw).wall_time
             / ipukit.simulate("1f1b", 4, ga, **kw).wall_time)
    measured = median(t["sharded"]) / median(t["pipelined"])
    rows = [row("imbalance", f"B{i + 1} forward + backward", c * 1e3, "ms/micro-batch",
                note=f"F {costs['forward'][i] * 1e3:.2f} + B {costs['backward'][i] * 1e3:.2f} ms"
                f" ({c / sum(per_stage):.0%})") for i, c in enumerate(per_stage)]
    rows += [row("imbalance", "mean ÷ slowest stage (1 = balanced)", balance, "×"),
             row("imbalance", f"modeled 4-IPU speed-up over sharded (GA {ga})", ideal, "×",
                 note="4 independent devices, these stage costs"),
             row("imbalance", f"measured pipelined ÷ sharded on {cores()} cores", measured, "×")]
    return {"rows": rows, "details": {"stage_costs": costs, "balance": balance,
                                      "modeled_speedup": ideal, "measured_speedup": measured}}


BENCHMARKS: Dict[str, Callable[[Sizes], dict]] = {
    "overhead": overhead, "pipeline": pipeline, "peers": peer_comparison,
    "device_iterations": device_iterations, "recording": recording,
    "simulate": simulate_speed, "compile": compile_time, "imbalance": imbalance,
}


def run_one(name: str, sizes: Sizes) -> dict:
    """Run one benchmark, timing it and keeping its failure (if any) as a result."""
    start = time.perf_counter()
    try:
        out = BENCHMARKS[name](sizes)
    except Exception as exc:  # noqa: BLE001 - a broken benchmark is reported, not fatal
        out = {"rows": [row(name, "failed", float("nan"), note=f"{type(exc).__name__}: {exc}")],
               "details": {"error": repr(exc)}}
    out["seconds"] = time.perf_counter() - start
    return out
