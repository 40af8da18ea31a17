"""Each IPU's busy share, with more workers than cores, process by process.

    .venv/bin/python -m benchmarks.busy_spread             # → benchmarks/busy_spread.md / .json
    .venv/bin/python -m benchmarks.busy_spread --smoke --out /tmp/bench

With 4 virtual IPUs on 2 cores the executor pins worker i to core i mod 2, so each core
runs two workers. Which of the two runs at a moment is the OS's choice, and Linux did not
choose the same way twice: in one process a core's pair shared it in time slices (both
passes stretched, both counted busy), in the next process the same pair ran its passes in
turn (each pass at full speed after waiting for the core, which a worker does not count as
busy), and the core that took turns changed from process to process. The call's time
differed little between the two; each IPU's busy share did.

So the benchmark runs the same rows in several fresh processes (each row calibrated right
before its calls, as benchmarks/calibration.py does) and reports, per process, each IPU's
busy share (the median over the calls) beside the model's: the sliced value (the modeled
timeline's) and the range from passes run in turn to slices
(:func:`ipukit.calibrate.model_call`'s ``busy_range``). The spread between processes says
how close any one modeled value can be.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

from .common import write_result  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = ("convnet:gpipe, 4 IPUs", "convnet:1f1b, 4 IPUs", "vit:gpipe, 4 IPUs",
        "vit:1f1b, 4 IPUs")


def measure(name: str, labels: List[str], calls: int, ga: int = 8, di: int = 2) -> List[Dict]:
    """In this process: each row of ``name`` in ``labels`` calibrated, modeled and measured."""
    import torch

    from ipukit.calibrate import calibrate, model_call

    from .calibration import (_busy, _busy_range, _median_busy, _options, _timed_calls,
                              configs, setup)

    net, (x, y), blocks, (X, Y) = setup(name, ga, di)
    n = len(X)
    out = []
    for label, kind, stages, ipus in configs(blocks):
        if label not in labels:
            continue
        table = calibrate(net, (x, y), blocks,
                          optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4), cache=False)
        modeled = model_call(table, kind, stages, ga, iterations=di, stage_ipus=ipus,
                             samples=n)
        _, timelines = _timed_calls(net, _options(kind, stages, ipus, ga, di), X, Y, calls)
        out.append({"model": name, "config": label,
                    "measured_ms": statistics.median(t.wall_time for t in timelines) * 1e3,
                    "modeled_ms": modeled.wall_time * 1e3,
                    "in_turn_ms": modeled.meta.get("in_turn_wall_time", 0.0) * 1e3,
                    "busy_calls": [_busy(t) for t in timelines],
                    "busy_measured": _median_busy(timelines),
                    "busy_modeled": _busy(modeled),
                    "busy_range": _busy_range(modeled)})
    return out


def run(rows=ROWS, processes: int = 4, calls: int = 5) -> Dict:
    """Every row in each of ``processes`` fresh interpreters (one per model and process)."""
    import torch

    by_model: Dict[str, List[str]] = {}
    for row in rows:
        name, label = row.split(":", 1)
        by_model.setdefault(name, []).append(label)
    found: Dict[tuple, List[Dict]] = {}
    for p in range(processes):
        for name, labels in by_model.items():
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "rows.json")
                subprocess.run([sys.executable, "-m", "benchmarks.busy_spread", "--child",
                                name, "--labels", json.dumps(labels), "--calls", str(calls),
                                "--out", path], check=True, cwd=os.path.dirname(HERE))
                with open(path) as f:
                    for r in json.load(f):
                        found.setdefault((r["model"], r["config"]), []).append(r)
                        print(f"process {p + 1}: {r['model']} {r['config']}: busy "
                              + ", ".join(f"{b:.0%}" for b in r["busy_measured"]), flush=True)
    return {"rows": [{"model": m, "config": c, "processes": v} for (m, c), v in found.items()],
            "calls": calls, "processes": processes, "cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch": torch.__version__, "load": os.getloadavg()}


def _outside(measured: List[float], ranges) -> float:
    """Points by which the furthest IPU lies outside its range."""
    return max(max(0.0, lo - m, m - hi) for m, (lo, hi) in zip(measured, ranges)) * 100


def _core_regime(proc: Dict, cores: int) -> str:
    """Per core: did its workers' busy shares add up nearer to passes in turn or slices?"""
    ranges = proc.get("busy_range")
    if not ranges:
        return "—"
    said = []
    for c in range(cores):
        mine = range(c, len(ranges), cores)
        got = sum(proc["busy_measured"][i] for i in mine)
        low = sum(ranges[i][0] for i in mine)
        high = sum(ranges[i][1] for i in mine)
        said.append(f"core {c}: {'in turn' if abs(got - low) < abs(got - high) else 'slices'}")
    return ", ".join(said)


def report(result: Dict) -> str:
    cores = result["cores"]
    lines = [f"# Busy per IPU with more workers than cores, process by process ({cores} "
             f"cores, torch {result['torch']}; each process a fresh interpreter, each row "
             f"calibrated right before its calls; measured: the median of {result['calls']} "
             "calls per IPU)", "",
             "| model | configuration | process | measured ms/call | modeled ms/call "
             "| busy per IPU measured | modeled (slices) | modeled range (in turn – slices) "
             "| outside the range (points) | off the sliced value (points) "
             "| each core's pair, nearer to |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    for row in result["rows"]:
        procs = row["processes"]
        for k, p in enumerate(procs):
            rng = p.get("busy_range") or [(b, b) for b in p["busy_modeled"]]
            off = max(abs(a - b) for a, b in zip(p["busy_measured"], p["busy_modeled"])) * 100
            lines.append(
                f"| {row['model']} | {row['config']} | {k + 1} | {p['measured_ms']:.0f} "
                f"| {p['modeled_ms']:.0f} "
                f"| {', '.join(f'{b:.0%}' for b in p['busy_measured'])} "
                f"| {', '.join(f'{b:.0%}' for b in p['busy_modeled'])} "
                f"| {', '.join(f'{lo:.0%}–{hi:.0%}' for lo, hi in rng)} "
                f"| {_outside(p['busy_measured'], rng):.0f} | {off:.0f} "
                f"| {_core_regime(p, cores)} |")
        ipus = len(procs[0]["busy_measured"])
        spread = [max(p["busy_measured"][i] for p in procs)
                  - min(p["busy_measured"][i] for p in procs) for i in range(ipus)]
        within = [(b - a) for p in procs for a, b in
                  [(min(c[i] for c in p["busy_calls"]), max(c[i] for c in p["busy_calls"]))
                   for i in range(ipus)]]
        inside = sum(_outside(p["busy_measured"], p.get("busy_range")
                              or [(b, b) for b in p["busy_modeled"]]) <= 10 for p in procs)
        sliced = sum(max(abs(a - b) for a, b in zip(p["busy_measured"], p["busy_modeled"]))
                     <= 0.10 for p in procs)
        summary.append(
            f"- {row['model']}, {row['config']}: between processes each IPU's share moved by "
            + ", ".join(f"{s * 100:.0f}" for s in spread)
            + f" points (IPU 0, 1, …); between the calls of one process by up to "
            f"{max(within) * 100:.0f}. Within ±10 points of the modeled range: {inside} of "
            f"{len(procs)} processes; of the sliced value alone: {sliced} of {len(procs)}.")
    return "\n".join(lines + ["", *summary, ""]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rows", default=";".join(ROWS),
                    help="';'-separated model:configuration (benchmarks/calibration.py's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--labels", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        with open(args.out, "w") as f:
            json.dump(measure(args.child, json.loads(args.labels), args.calls), f)
        return 0
    if args.smoke and os.path.abspath(args.out) == HERE:
        ap.error("--smoke needs --out (it never writes over the recorded results)")
    rows = ["convnet:1f1b, 4 IPUs"] if args.smoke else args.rows.split(";")
    result = run(rows, processes=2 if args.smoke else args.processes,
                 calls=2 if args.smoke else args.calls)
    write_result(args.out, "busy_spread", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
