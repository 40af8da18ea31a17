"""The planner's choice against a measured grid of plans.

    .venv/bin/python -m benchmarks.planner                 # → benchmarks/planner.md
    .venv/bin/python -m benchmarks.planner --smoke --out /tmp/bench

For the tutorial convnet (``ipukit.examples.mnist``) and the example ViT
(``ipukit.examples.vit``) on 2 virtual IPUs:

1. :func:`ipukit.plan` plans (calibration included, nothing cached) over the grid's
   schedules and micro-batch sizes, at the tutorial's global batch and device iterations;
2. every plan of the grid (splits × schedules × micro-batch size / accumulation, plus the
   planner's choice if the grid lacks it) is **measured**: compile, a warm-up call, then
   the median wall time of ``calls`` calls (each call's measured timeline), in ``rounds``
   round-robin passes over the grid (the median of every call of every round);
3. the default plan (the tutorial's settings: an even split, 1F1B, its micro-batch, GA and
   DI) is measured once more at the end: the spread of its rounds and that last
   measurement (max − min over median) is the grid's noise;
4. the planner's plan and the default, side by side (:func:`head_to_head`): alternating
   rounds on copies of the same weights, the speed-up a paired ratio with its own noise —
   the project's rule for a ratio, and far steadier than measurements minutes apart.

Goals: the suggested plan measures within 10 % of the best measured plan; it is faster
than the default by more than the measured noise; planning takes under 10 % of the time
measuring the grid takes. Also reported: how right the linear interpolation of costs
between two calibrated micro-batch sizes is, against a calibration at the middle size.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import torch  # noqa: E402

import ipukit  # noqa: E402
from ipukit.balance import discover_blocks  # noqa: E402
from ipukit.calibrate import calibrate  # noqa: E402
from ipukit.plan import Plan, resized, stages_of, table_at, stage_placement  # noqa: E402
from ipukit.timeline.costs import even_split  # noqa: E402
from ipukit.timeline.simulate import available_cores  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _convnet():
    from ipukit.examples.mnist import Network, TrainingModelWithLoss

    # notebook 01: micro-batch 40, gradientAccumulation 10, deviceIterations 10
    return TrainingModelWithLoss(Network()), dict(micro_batch=40, ga=10, di=10,
                                                 split=[2, 2], sizes=[20, 40, 80])


def _vit():
    from ipukit.examples.vit import ViT
    from ipukit.ipuconfig import IPUConfig

    vit = ViT(num_layers=8)
    # vit_ipu_config.json's batching (micro-batch 16, GA 8, DI 4); its layers_per_ipu
    # [2, 2, 2, 2] on 2 IPUs is [4, 4]: the embeddings + 4 layers, 4 layers + the head
    vit.parallelize(IPUConfig(layers_per_ipu=[4, 4], ipus_per_replica=2))
    return vit, dict(micro_batch=16, ga=8, di=4, split=[5, 6], sizes=[8, 16, 32])


MODELS = {"convnet": _convnet, "vit": _vit}
SCHEDULES = ("1f1b", "gpipe", "zb-h1", "zbv")


def grid(blocks: List[str], ipus: int, default_split: List[int], sizes: List[int],
         global_batch: int) -> List[tuple]:
    """(kind, split, micro-batch, GA) of every plan measured."""
    n = len(blocks)
    line = [default_split]
    for d in (-1, 1):   # the default split's neighbours: one block moved across the cut
        sp = [default_split[0] + d, default_split[1] - d]
        if min(sp) >= 1:
            line.append(sp)
    v = [[len(s) for s in even_split(blocks, 2 * ipus)]] if n >= 2 * ipus else []
    out = []
    for kind in SCHEDULES:
        splits = v if kind in ("zbv", "dualpipev") else line
        for sp in splits:
            for m in sizes:
                out.append((kind, sp, m, global_batch // m))
    return out


def plan_for(blocks, ipus, kind, split, m, ga, di) -> Plan:
    stages = stages_of(blocks, split)
    return Plan(blocks=list(blocks), stages=stages,
                stage_ipus=stage_placement(kind, len(stages), ipus),
                schedule=kind, micro_batch=m, gradient_accumulation=ga, device_iterations=di,
                recompute=[], time_per_call=0.0, memory_per_ipu=[], ipus=ipus)


def measure(net, plan: Plan, x, y, calls: int) -> Dict:
    """Compile + warm up, then ``calls`` calls: per-call measured wall times (timeline)."""
    t0 = time.perf_counter()
    model = ipukit.trainingModel(net, plan.apply(net),
                                 optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4))
    try:
        n = plan.samples_per_call
        X, Y = resized((x, y), n)
        model(X, Y)
        walls = []
        for _ in range(calls):
            model(X, Y)
            walls.append(model.getTimeline().wall_time)
    finally:
        model.destroy()
    return {"walls": walls, "median": statistics.median(walls),
            "spread": (max(walls) - min(walls)) / statistics.median(walls),
            "seconds": time.perf_counter() - t0}


def interpolation_check(net, x, y, blocks, sizes, optimizer) -> Dict:
    """Block costs interpolated at the middle size from the two ends, against a calibration
    at the middle size (the sum of forward + backward over blocks, and the worst block)."""
    lo, hi = (calibrate(net, resized((x, y), m), blocks, optimizer=optimizer) for m in
              (sizes[0], sizes[-1]))
    mid = sizes[len(sizes) // 2]
    measured = calibrate(net, resized((x, y), mid), blocks, optimizer=optimizer, cache=False)
    guess = table_at([lo, hi], mid)
    tot_m = sum(measured.forward) + sum(measured.backward)
    tot_g = sum(guess.forward) + sum(guess.backward)
    per_block = [abs((gf + gb) - (mf + mb)) / (mf + mb) for gf, gb, mf, mb in
                 zip(guess.forward, guess.backward, measured.forward, measured.backward)
                 if mf + mb > 0]
    # the proportional guess from one table (the middle's nearest end) for comparison
    prop = table_at([hi], mid)
    tot_p = sum(prop.forward) + sum(prop.backward)
    return {"middle": mid, "total_error": (tot_g - tot_m) / tot_m,
            "worst_block_error": max(per_block) if per_block else 0.0,
            "proportional_error": (tot_p - tot_m) / tot_m}


def spearman(pairs) -> float:
    """Rank correlation of (modeled, measured) pairs (1: the model orders plans as measured)."""
    if len(pairs) < 3:
        return float("nan")

    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    a, b = ranks([p[0] for p in pairs]), ranks([p[1] for p in pairs])
    n = len(pairs)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1))


def head_to_head(net, mine: Plan, default: Plan, x, y, rounds: int = 8,
                 per_round: int = 2) -> Dict:
    """The planner's plan against the default side by side: both compiled on copies of
    ``net`` (same weights), then called in alternating rounds (``common.interleaved``);
    the speed-up is the median over rounds of default ÷ planner (each round's fastest
    call), the noise half the interquartile range of those round ratios
    (``common.paired_ratio``). Both plans cut the same samples per call."""
    import copy

    from .common import interleaved, paired_ratio

    models, calls = {}, {}
    for name, plan in (("planner", mine), ("default", default)):
        copy_of = copy.deepcopy(net)
        model = ipukit.trainingModel(copy_of, plan.apply(copy_of),
                                     optimizer=torch.optim.AdamW(copy_of.parameters(), lr=1e-4))
        X, Y = resized((x, y), plan.samples_per_call)
        model(X, Y)   # compile and warm up
        models[name] = model
        calls[name] = (lambda m=model, X=X, Y=Y: m(X, Y))
    try:
        times = interleaved(calls, rounds, per_round)
    finally:
        for model in models.values():
            model.destroy()
    speedup, noise = paired_ratio(times["default"], times["planner"], per_round)
    return {"speedup": speedup, "noise": noise, "rounds": rounds, "per_round": per_round,
            "planner_ms": min(times["planner"]) * 1e3, "default_ms": min(times["default"]) * 1e3}


def run(models=("convnet", "vit"), ipus: int = 2, calls: int = 2, rounds: int = 2,
        smoke: bool = False) -> Dict:
    results = {}
    for name in models:
        torch.manual_seed(0)
        net, d = MODELS[name]()
        if smoke:
            d = dict(d, sizes=d["sizes"][:2], di=1)
        global_batch = d["micro_batch"] * d["ga"]
        x = torch.randn(max(d["sizes"]), 1, 28, 28)
        y = torch.randint(0, 10, (max(d["sizes"]),))
        blocks = discover_blocks(net, (x, y))
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
        t0 = time.perf_counter()
        chosen = ipukit.plan(net, (x, y), ipus=ipus, global_batch=global_batch,
                             schedules=list(SCHEDULES), micro_batch_sizes=d["sizes"],
                             device_iterations=d["di"], optimizer=optimizer, recompute=False,
                             repeats=4 if smoke else 8)
        planning = time.perf_counter() - t0
        points = grid(blocks, ipus, d["split"], d["sizes"], global_batch)
        if smoke:
            points = points[:3]
        key = (chosen.schedule, chosen.split, chosen.micro_batch)
        if key not in [(k, sp, m) for k, sp, m, _ in points]:
            points.append((chosen.schedule, chosen.split, chosen.micro_batch,
                           chosen.gradient_accumulation))
        default_key = ("1f1b", d["split"], d["micro_batch"])
        modeled = {(p.schedule, tuple(p.split), p.micro_batch): p
                   for p in chosen.alternatives}
        grid_seconds = 0.0
        walls: Dict[int, List[float]] = {i: [] for i in range(len(points))}
        spreads: Dict[int, List[float]] = {i: [] for i in range(len(points))}
        plans = [plan_for(blocks, ipus, k, sp, m, ga, d["di"]) for k, sp, m, ga in points]
        # round robin: each plan once per round, so a burst of load on the shared machine
        # hits every plan rather than a few neighbours
        for _ in range(rounds):
            for i, p in enumerate(plans):
                got = measure(net, p, x, y, calls)
                grid_seconds += got["seconds"]
                walls[i] += [w / p.samples_per_call * 1e3 for w in got["walls"]]
                spreads[i].append(got["median"] / p.samples_per_call * 1e3)
        rows = []
        for i, (p, (kind, sp, m, ga)) in enumerate(zip(plans, points)):
            alt = modeled.get((kind, tuple(sp), m))
            med = statistics.median(walls[i])
            row = {"schedule": p.title, "split": sp, "micro_batch": m, "ga": ga,
                   "measured_ms_per_sample": med,
                   "spread": (max(spreads[i]) - min(spreads[i])) / med,
                   "modeled_ms_per_sample": alt.time_per_sample * 1e3 if alt else None,
                   "chosen": (kind, sp, m) == key, "default": (kind, sp, m) == default_key}
            rows.append(row)
            print(f"{name}: {p.title} {sp} {m}×{ga}: {med:.4f} ms/sample (modeled "
                  f"{row['modeled_ms_per_sample'] or float('nan'):.4f})", flush=True)
        # the default again, last: its measurements far apart in time give the noise
        dp = plan_for(blocks, ipus, "1f1b", d["split"], d["micro_batch"], d["ga"], d["di"])
        again = measure(net, dp, x, y, calls)
        again_ms = again["median"] / dp.samples_per_call * 1e3
        mine_plan = plans[[r["chosen"] for r in rows].index(True)]
        h2h = (head_to_head(net, mine_plan, dp, x, y, rounds=4 if smoke else 8)
               if (mine_plan.schedule, mine_plan.split, mine_plan.micro_batch)
               != (dp.schedule, dp.split, dp.micro_batch) else None)
        interp = interpolation_check(net, x, y, blocks, d["sizes"], optimizer) \
            if len(d["sizes"]) >= 3 else None
        best = min(rows, key=lambda r: r["measured_ms_per_sample"])
        mine = next(r for r in rows if r["chosen"])
        default = next((r for r in rows if r["default"]), None)
        noise = None
        if default is not None:
            runs = spreads[rows.index(default)] + [again_ms]
            noise = (max(runs) - min(runs)) / statistics.median(runs)
        pairs = [(r["modeled_ms_per_sample"], r["measured_ms_per_sample"]) for r in rows
                 if r["modeled_ms_per_sample"] is not None]
        results[name] = {
            "blocks": blocks, "global_batch": global_batch, "device_iterations": d["di"],
            "chosen": chosen.summary(), "chosen_modeled_ms": chosen.time_per_sample * 1e3,
            "planning_seconds": planning, "grid_seconds": grid_seconds, "rows": rows,
            "best": best, "mine": mine, "default": default, "noise": noise,
            "default_again_ms_per_sample": again_ms, "rank_correlation": spearman(pairs),
            "head_to_head": h2h,
            "rounds": rounds, "calls": calls,
            "interpolation": interp, "notes": chosen.notes, "modeled_only": chosen.modeled_only}
    return results


def _pct(v) -> str:
    return "n/a" if v is None else f"{v * 100:+.1f} %"


def markdown(results: Dict, ipus: int, cores: int, load) -> str:
    lines = ["# The planner against a measured grid", "",
             f"`python -m benchmarks.planner`: {ipus} virtual IPUs on a machine with {cores} "
             f"cores (load average at the end {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; "
             "the machine is shared, so timings are noisy). torch "
             f"{torch.__version__}, one intra-op thread. Every time is the median of the "
             "measured calls' wall time "
             "(each call's timeline) per sample; modeled is the planner's figure for the same "
             "plan. The planner searched the grid's schedules and micro-batch sizes (and every "
             "split), without recomputation and without a memory budget.", ""]
    for name, r in results.items():
        best, mine, default = r["best"], r["mine"], r["default"]
        lines += [f"## {name} ({len(r['blocks'])} blocks, global batch {r['global_batch']}, "
                  f"device iterations {r['device_iterations']}; {r['rounds']} rounds of "
                  f"{r['calls']} calls per plan)", "",
                  f"Planner's choice: {r['chosen']} (modeled {r['chosen_modeled_ms']:.4f} "
                  "ms per sample).", "",
                  "| schedule | split | micro-batch × GA | measured ms/sample | spread of rounds "
                  "| modeled ms/sample | |", "|---|---|---|---|---|---|---|"]
        for row in sorted(r["rows"], key=lambda x: x["measured_ms_per_sample"]):
            tag = ", ".join(t for t, on in (("**planner**", row["chosen"]),
                                            ("default", row["default"]),
                                            ("best measured", row is best)) if on)
            mod = "—" if row["modeled_ms_per_sample"] is None else \
                f"{row['modeled_ms_per_sample']:.4f}"
            lines.append(f"| {row['schedule']} | {row['split']} | {row['micro_batch']} × "
                         f"{row['ga']} | {row['measured_ms_per_sample']:.4f} | "
                         f"{row['spread'] * 100:.0f} % | {mod} | {tag} |")
        gap = mine["measured_ms_per_sample"] / best["measured_ms_per_sample"] - 1
        lines += ["", "| goal | value | verdict |", "|---|---|---|",
                  f"| planner's plan within 10 % of the best measured | {gap * 100:+.1f} % | "
                  f"{'met' if gap <= 0.10 else 'missed'} |"]
        if default is not None:
            win = 1 - mine["measured_ms_per_sample"] / default["measured_ms_per_sample"]
            noise = r["noise"] or 0.0
            lines.append(f"| faster than the default by more than the noise | {win * 100:+.1f} % "
                         f"faster; noise {noise * 100:.1f} % (default measured again: "
                         f"{r['default_again_ms_per_sample']:.4f} ms/sample) | "
                         f"{'met' if win > noise else 'missed'} |")
        h2h = r.get("head_to_head")
        if h2h is not None:
            gain, hn = h2h["speedup"] - 1, h2h["noise"]
            ok = gain > hn if hn == hn else gain > 0
            lines.append(f"| the same, side by side: default ÷ planner, {h2h['rounds']} "
                         f"alternating rounds of {h2h['per_round']} calls | {gain * 100:+.1f} % "
                         f"faster; noise ±{hn * 100:.1f} % (fastest calls {h2h['planner_ms']:.1f} vs "
                         f"{h2h['default_ms']:.1f} ms) | {'met' if ok else 'missed'} |")
        elif default is not None and mine is default:
            lines.append("| the same, side by side | the planner chose the default | — |")
        lines.append(f"| (not a goal) the model orders the plans as measured: rank correlation "
                     f"| {r['rank_correlation']:.2f} | — |")
        share = r["planning_seconds"] / r["grid_seconds"]
        lines.append(f"| planning (calibration included) under 10 % of measuring the grid | "
                     f"{r['planning_seconds']:.1f} s vs {r['grid_seconds']:.1f} s: "
                     f"{share * 100:.1f} % | {'met' if share < 0.10 else 'missed'} |")
        if r["interpolation"]:
            it = r["interpolation"]
            lines += ["", f"Costs at micro-batch {it['middle']}, interpolated between the two "
                      f"calibrated sizes against a calibration there: the blocks' total "
                      f"{_pct(it['total_error'])}, worst block {it['worst_block_error'] * 100:.1f} "
                      f"%; scaled in proportion from the largest size instead: "
                      f"{_pct(it['proportional_error'])}."]
        lines += [""] + [f"- {n}" for n in r["notes"]] + [""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny grid (checks it runs)")
    ap.add_argument("--out", default=None, help="folder for planner.md (default benchmarks/)")
    ap.add_argument("--models", default="convnet,vit")
    ap.add_argument("--calls", type=int, default=2, help="timed calls per plan and round")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the grid")
    args = ap.parse_args(argv)
    if args.smoke and args.out is None:
        print("--smoke writes tiny numbers: give --out", file=sys.stderr)
        return 2
    ipus = 2
    # one intra-op thread per worker: two workers on two cores. With torch's default pool
    # (one thread per core) each worker's ops wait on threads the other worker (or, on a
    # shared machine, another process) holds, and blocks ran 10-50x slower, in bursts.
    torch.set_num_threads(1)
    results = run(tuple(args.models.split(",")), ipus=ipus, calls=1 if args.smoke else args.calls,
                  rounds=1 if args.smoke else args.rounds, smoke=args.smoke)
    out = args.out or HERE
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "planner.md"), "w") as f:
        f.write(markdown(results, ipus, available_cores(), os.getloadavg()))
    print(open(os.path.join(out, "planner.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
