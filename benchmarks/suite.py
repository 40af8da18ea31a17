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
from .common import model_like
from benchmarks.common import uncontended_costs
from ipukit.timeline.events import Timeline

from . import anchor, distributed, passes, peers, pipeline_win
from .common import (BATCH, Sizes, Unavailable, cores, interleaved, median, paired_ratio,
                     threads, timed, verdict)
from .models import (PlainStep, balanced_data, balanced_ipukit, tiny_pair, tutorial_data,
                     tutorial_pipelined, tutorial_single_stage)


def row(section: str, metric: str, value: float, unit: str = "", goal: Optional[str] = None,
        met: Optional[bool] = None, note: str = "") -> dict:
    return {"section": section, "metric": metric, "value": value, "unit": unit, "goal": goal,
            "met": met, "note": note}


def _noise(value: float, unit: str = "") -> str:
    return "noise n/a" if value != value else f"noise ±{value:.3f}{unit}"


def host_seconds(tl: Timeline) -> float:
    """Host-track time of a call: splitting inputs before the run, gathering outputs after."""
    return sum(e.duration for e in tl.events if e.ipu < 0 and e.kind == "host")


# -- 1. overhead -----------------------------------------------------------------
def overhead(s: Sizes) -> dict:
    """ipukit's single-stage step ÷ a hand-written PyTorch step, tutorial model, batch 40."""
    one, ten = _tutorial_overhead(s)
    fixed = _fixed_overhead(s)
    rows = [row("overhead", "single-stage step ÷ plain PyTorch step (DI 1)", one["ratio"], "×",
                "≤ 1.02", verdict(one["ratio"], one["noise"], 1.02),
                f"{one['ipukit'] * 1e3:.2f} ms vs {one['plain'] * 1e3:.2f} ms; "
                f"{_noise(one['noise'])}; timeline host "
                f"spans {one['host'] * 1e3:.2f} ms/call"),
            row("overhead", "single-stage step ÷ plain PyTorch step (DI 10)", ten["ratio"], "×",
                "≤ 1.02", verdict(ten["ratio"], ten["noise"], 1.02),
                f"{ten['ipukit'] * 1e2:.2f} ms vs {ten['plain'] * 1e2:.2f} ms per step; "
                f"{_noise(ten['noise'])}"),
            row("overhead", "undoable call: one copy of weights, buffers, optimiser state",
                one["undo_copy"] * 1e6, "µs",
                note=f"{one['undo_copy'] / one['plain']:.1%} of the plain step, timed alone; a "
                "failed call restores from it (docs/errors.md's promise), so every call pays it"),
            row("overhead", "fixed cost per call (4×4 linear model)", fixed["extra"] * 1e6, "µs",
                note=f"ipukit {fixed['ipukit'] * 1e6:.0f} µs vs plain {fixed['plain'] * 1e6:.0f} µs"
                f"; without recording {fixed['ipukit_norec'] * 1e6:.0f} µs")]
    return {"rows": rows, "details": {"tutorial_di1": one, "tutorial_di10": ten, "tiny": fixed,
                                      "threads": torch.get_num_threads()}}


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
    one["undo_copy"] = _undo_copy_seconds(plain, s.rounds * s.steps_per_round)
    ten = _pair({"ipukit": lambda: ten_model(x, y),
                 "plain": lambda: [plain(a, b) for a, b in chunks]},
                "ipukit", "plain", s.rounds, max(1, s.steps_per_round // 5))
    return one, ten


def _undo_copy_seconds(plain: PlainStep, reps: int) -> float:
    """What making a call undoable costs: ipukit's snapshot of the same net and AdamW state."""
    from ipukit.runtime.update import StateSnapshot

    snap = StateSnapshot()
    return median(timed(lambda: snap.capture(plain.net, plain.optimizer, True), max(5, reps)))


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
def utilisation_ratios(model, tl: Timeline, compute: Dict[str, List[float]]) -> Dict[str, float]:
    """Measured utilisation beside the schedule model's, two ways.

    ``ratio``: as asked — the model fed this call's own passes (each stage's
    mean pass, contention taken out: ``uncontended_costs``) on this machine's
    cores (``model_like(tl, cores=...)``), as ``benchmarks/schedules.py`` does.
    ``efficiency``: the model fed wait-free compute costs (from a sharded
    run: one stage at a time, nothing to wait for), modeled wall ÷ measured
    wall — the same as true measured utilisation ÷ modeled utilisation.
    """
    sched = model.program.schedule
    args = (sched.kind, sched.num_stages, sched.micro_batches)
    own = model_like(tl, cores=cores(), costs=uncontended_costs(tl, cores(), "mean"))
    wait_free = ipukit.simulate(*args, **compute, schedule=sched)
    measured = tl.utilisation()["overall"]
    devices_only = Timeline(tl.device_events()).utilisation()["overall"]
    modeled = own.utilisation()["overall"]
    return {"measured": measured, "measured_devices_only": devices_only, "modeled": modeled,
            "ratio": measured / modeled, "ratio_devices_only": devices_only / modeled,
            "modeled_wait_free": wait_free.utilisation()["overall"],
            "efficiency": wait_free.wall_time / tl.wall_time}


def _recording(model, x, y, into: List[Timeline], cpu: Optional[List[float]] = None) -> Callable:
    """Call the model, keep its timeline and (optionally) the cores it got: process CPU ÷ wall."""
    def run():
        wall, used = time.perf_counter(), time.process_time()
        model(x, y)
        if cpu is not None:
            cpu.append((time.process_time() - used) / (time.perf_counter() - wall))
        into.append(model.getTimeline())

    return run


def _core_capped(model, compute: Dict[str, List[float]], timelines: List[Timeline]) -> float:
    """Modeled wall, but never below the call's compute spread over this machine's cores."""
    sched = model.program.schedule
    modeled = ipukit.simulate(sched.kind, sched.num_stages, sched.micro_batches, **compute,
                              schedule=sched).wall_time
    work = sched.micro_batches * (sum(compute["forward_cost"]) + sum(compute["backward_cost"]))
    bound = max(modeled, work / cores())
    return median([bound / tl.wall_time for tl in timelines])


def _pipeline_for(s: Sizes, n: int) -> dict:
    x, y = balanced_data(s.width, s.micro_batch * s.micro_batches)
    pipe = balanced_ipukit(n, s.width, s.layers_per_stage, s.micro_batches)
    shard = balanced_ipukit(n, s.width, s.layers_per_stage, s.micro_batches, sharded=True)
    piped, sharded, cpu = [], [], []
    variants = {"pipelined": _recording(pipe, x, y, piped, cpu),
                "sharded": _recording(shard, x, y, sharded)}
    variants.update(_all_cores_variant("sharded_all_cores", lambda: shard(x, y)))
    t = _warm_and_interleave(variants, max(1, s.pipeline_calls // 2), 2)
    compute = ipukit.costs_from(Timeline.concat(sharded[1:]))
    ratios = [utilisation_ratios(pipe, tl, compute) for tl in piped[1:]]
    summary = {k: median([r[k] for r in ratios]) for k in ratios[0]}
    summary.update({f"{k}_samples_s": x.shape[0] / median(v) for k, v in t.items()})
    summary["cores_used"] = median(cpu[1:])
    summary["core_capped_efficiency"] = _core_capped(pipe, compute, piped[1:])
    summary["stage_costs_pipelined"] = piped[-1].stage_costs()
    summary["stage_costs_sharded"] = compute
    return summary


def _all_cores_variant(name: str, fn: Callable) -> Dict[str, Callable]:
    """``fn`` again with every core as intra-op threads, unless that is already the setting."""
    if torch.get_num_threads() == cores():
        return {}

    def run():
        with threads(cores()):
            return fn()

    return {name: run}


def _warm_and_interleave(variants: Dict[str, Callable], rounds: int,
                         per_round: int) -> Dict[str, List[float]]:
    for fn in variants.values():
        fn()
    return interleaved(variants, rounds, per_round)


def _speedup_rows(section: str, label: str, d: dict, fast: str) -> List[dict]:
    """``fast`` ÷ sharded, at the suite's thread count and (when different) on all cores."""
    out = []
    for key, how in (("sharded", f"{torch.get_num_threads()} thread(s)"),
                     ("sharded_all_cores", f"{cores()} threads")):
        if f"{key}_samples_s" in d:
            a, b = d[f"{fast}_samples_s"], d[f"{key}_samples_s"]
            out.append(row(section, f"{label} ÷ sharded with {how} per op", a / b, "×",
                           note=f"{a:.0f} vs {b:.0f} samples/s"))
    return out


def _efficiency_verdict(d: dict, n: int) -> Optional[bool]:
    """The model assumes one free core per stage: without them the goal cannot be judged."""
    if d["efficiency"] < 0.9 and d["cores_used"] < 0.9 * min(n, cores()):
        return None
    return d["efficiency"] >= 0.9


def pipeline(s: Sizes) -> dict:
    """Balanced N-stage model: measured vs modeled utilisation, and pipelined vs sharded."""
    rows, details = [], {}
    for n in s.stage_counts:
        d = details[f"{n}_stages"] = _pipeline_for(s, n)
        goal = "≥ 0.9" if n == 2 else None
        rows += [
            row("pipeline", f"{n} stages: measured ÷ modeled utilisation, wait-free costs",
                d["efficiency"], "×", goal, _efficiency_verdict(d, n) if goal else None,
                f"modeled {d['modeled_wait_free']:.1%} from a sharded run's stage costs "
                f"(= modeled wall ÷ measured wall); the pipeline got {d['cores_used']:.2f} of "
                f"{cores()} cores; vs a {cores()}-core bound {d['core_capped_efficiency']:.3f}"),
            row("pipeline", f"{n} stages: measured ÷ modeled utilisation, the call's own passes "
                f"on {cores()} cores", d["ratio"], "×", goal, d["ratio"] >= 0.9 if goal else None,
                f"measured {d['measured']:.1%}, modeled {d['modeled']:.1%}; devices only "
                f"{d['measured_devices_only']:.1%}")]
        rows += _speedup_rows("pipeline", f"{n} stages: pipelined throughput", d, "pipelined")
    return {"rows": rows, "details": details}


# -- 3. peers ------------------------------------------------------------------------
def _peer_in_process(s: Sizes, n: int) -> Dict[str, float]:
    """ipukit (GPipe and 1F1B schedules) and torchgpipe, interleaved in this process.

    torchgpipe's only parallelism on CPU is intra-op, so it also runs with
    every core as threads; the better of its two runs is the one compared.
    """
    x, y = balanced_data(s.width, s.micro_batch * s.micro_batches)
    args = (n, s.width, s.layers_per_stage, s.micro_batches)
    gpipe = balanced_ipukit(*args, schedule="GPipe")
    f1b1 = balanced_ipukit(*args, schedule="1F1B")
    tg = peers.torchgpipe_step(n, s.width, s.layers_per_stage, s.micro_batch, s.micro_batches)
    variants = {"ipukit_gpipe": lambda: gpipe(x, y), "ipukit_1f1b": lambda: f1b1(x, y),
                "torchgpipe": tg}
    variants.update(_all_cores_variant("torchgpipe_all_cores", tg))
    t = _warm_and_interleave(variants, max(1, s.pipeline_calls // 2), 2)
    out = {k: x.shape[0] / median(v) for k, v in t.items()}
    out["torchgpipe_best"] = max(out["torchgpipe"], out.get("torchgpipe_all_cores", 0.0))
    return out


def peer_comparison(s: Sizes) -> dict:
    """ipukit ÷ torchgpipe and ÷ torch.distributed.pipelining, same model and micro-batches."""
    import importlib.util

    if importlib.util.find_spec("torchgpipe") is None:
        raise Unavailable('torchgpipe is not installed (pip install "ipukit[bench]")')
    rows, details = [], {}
    for n in s.stage_counts:
        d = _peer_in_process(s, n)
        threads = max(1, cores() // n)
        times = peers.torch_pipelining_times(n, s.width, s.layers_per_stage, s.micro_batch,
                                             s.micro_batches, reps=s.pipeline_calls,
                                             threads=threads)
        d["torch_pipelining"] = s.micro_batch * s.micro_batches / median(times)
        details[f"{n}_stages"] = d
        for peer, label in (("torchgpipe_best", "torchgpipe 0.0.7 GPipe"),
                            ("torch_pipelining", "torch.distributed.pipelining ScheduleGPipe")):
            rows.append(row("peers", f"{n} stages: ipukit GPipe ÷ {label}",
                            d["ipukit_gpipe"] / d[peer], "×", None, None,
                            f"{d['ipukit_gpipe']:.0f} vs {d[peer]:.0f} samples/s "
                            f"(ipukit 1F1B {d['ipukit_1f1b']:.0f})"))
    return {"rows": rows, "details": details}


# -- 4. device iterations --------------------------------------------------------------
def _di_variant(model, x, y, calls: int) -> Callable:
    model.compile(x, y)

    def run():
        for _ in range(calls):
            model(x, y)

    return run


def device_iterations(s: Sizes) -> dict:
    """Samples/s at batch 40 as device iterations amortise each call's host work.

    The DI variants of a model are interleaved round by round, each round
    processing about ``di_samples`` samples per variant (at least one call).
    """
    rows, details = [], {}
    for label, make, ga in (("tutorial 4-stage pipelined", tutorial_pipelined, s.tutorial_ga),
                            ("single stage", lambda _, di: tutorial_single_stage(di), 1)):
        variants, samples = {}, {}
        for di in s.device_iterations:
            per_call = BATCH * di * ga
            calls = max(1, round(s.di_samples / per_call))
            x, y = tutorial_data(per_call)
            variants[di] = _di_variant(make(ga, di), x, y, calls)
            samples[di] = per_call * calls
        t = interleaved(variants, s.di_rounds, 1)
        for di in s.device_iterations:
            best, typical = samples[di] / min(t[di]), samples[di] / median(t[di])
            details[f"{label} DI {di}"] = {"samples_s_best": best, "samples_s_median": typical,
                                           "samples_per_round": samples[di], "ga": ga,
                                           "round_s": t[di]}
            rows.append(row("device iterations", f"{label}, GA {ga}, DI {di}", best, "samples/s",
                            note=f"best of {s.di_rounds} rounds of {samples[di]} samples "
                            f"(median {typical:.0f})"))
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
    for label, make, n, per_round in cases:
        x, y = tutorial_data(n)
        on, off = make(True), make(False)
        d = _pair({"on": lambda: on(x, y), "off": lambda: off(x, y)}, "on", "off",
                  s.rounds, per_round)
        d["ab_cost"] = d["ratio"] - 1.0
        d["direct_cost"] = _rebuild_cost(on.getTimeline()) / d["off"]
        d["events"] = len(on.getTimeline().events)
        details[label] = d
        rows += [row("recording", f"{label}: recording cost, A/B", d["ab_cost"] * 100,
                     "% of a step", "≤ 2 %", verdict(d["ab_cost"], d["noise"], 0.02),
                     _noise(d["noise"] * 100, " %")),
                 row("recording", f"{label}: recording cost, direct", d["direct_cost"] * 100,
                     "% of a step", "≤ 2 %", d["direct_cost"] <= 0.02,
                     f"creating, sorting and wrapping the call's {d['events']} events")]
    return {"rows": rows, "details": details}


# -- 6. schedule model speed ------------------------------------------------------------------
def simulate_speed(s: Sizes) -> dict:
    """Time to model one call of a 16-stage 1F1B pipeline (the explorer's largest case)."""
    m = s.simulate_micro_batches
    t = timed(lambda: ipukit.simulate("1f1b", 16, m), 5 if m >= 1024 else 2)
    events = 16 * m * 2 + 16
    goal = m >= 1024  # the goal is for 1024 micro-batches
    return {"rows": [row("schedule model", f"simulate('1f1b', 16, {m})", median(t) * 1e3, "ms",
                         "≤ 50" if goal else None, median(t) <= 0.050 if goal else None,
                         note=f"{events} actions; median of {len(t)}")],
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
    variants = {"pipelined": lambda: pipe(x, y), "sharded": lambda: shard(x, y)}
    variants.update(_all_cores_variant("sharded_all_cores", lambda: shard(x, y)))
    t = _warm_and_interleave(variants, max(1, s.rounds // 3), 2)
    costs = _sharded_costs(shard, x, y)
    per_stage = [f + b for f, b in zip(costs["forward"], costs["backward"])]
    balance = statistics.mean(per_stage) / max(per_stage)
    kw = {"forward_cost": costs["forward"], "backward_cost": costs["backward"]}
    ideal = (ipukit.simulate("sharded", 4, ga, **kw).wall_time
             / ipukit.simulate("1f1b", 4, ga, **kw).wall_time)
    rates = {f"{k}_samples_s": x.shape[0] / median(v) for k, v in t.items()}
    rows = [row("imbalance", f"B{i + 1} forward + backward", c * 1e3, "ms/micro-batch",
                note=f"F {costs['forward'][i] * 1e3:.2f} + B {costs['backward'][i] * 1e3:.2f} ms"
                f" ({c / sum(per_stage):.0%})") for i, c in enumerate(per_stage)]
    rows += [row("imbalance", "mean ÷ slowest stage (1 = balanced)", balance, "×"),
             row("imbalance", f"modeled 4-IPU speed-up over sharded (GA {ga})", ideal, "×",
                 note="4 independent devices, these stage costs; ≤ 4 × balance")]
    rows += _speedup_rows("imbalance", f"measured pipelined on {cores()} cores", rates,
                          "pipelined")
    return {"rows": rows, "details": {"stage_costs": costs, "balance": balance,
                                      "modeled_speedup": ideal, **rates}}


def _sharded_costs(shard, x, y, calls: int = 3) -> Dict[str, List[float]]:
    """Median per-stage costs over a few sharded calls (one stage runs at a time)."""
    timelines = []
    for _ in range(calls):
        shard(x, y)
        timelines.append(shard.getTimeline())
    return Timeline.concat(timelines).stage_costs()


BENCHMARKS: Dict[str, Callable[[Sizes], dict]] = {
    "overhead": overhead, "pipeline": pipeline, "peers": peer_comparison,
    "device_iterations": device_iterations, "recording": recording,
    "simulate": simulate_speed, "compile": compile_time, "imbalance": imbalance,
    "distributed": distributed.distributed, "anchor": anchor.anchor,
    "pipeline_win": pipeline_win.pipeline_win, "passes": passes.passes,
}


def run_one(name: str, sizes: Sizes) -> dict:
    """Run one benchmark, timing it and keeping its failure (if any) as a result."""
    start = time.perf_counter()
    try:
        out = BENCHMARKS[name](sizes)
    except Unavailable as why:
        out = {"rows": [row(name, "skipped", float("nan"), note=str(why))],
               "details": {"skipped": str(why)}}
    except Exception as exc:  # noqa: BLE001 - a broken benchmark is reported, not fatal
        out = {"rows": [row(name, "failed", float("nan"), note=f"{type(exc).__name__}: {exc}")],
               "details": {"error": repr(exc)}}
    out["seconds"] = time.perf_counter() - start
    return out
