"""The CPU calibration table on a many-core machine, as on quiet 2-core CPUs side by side.

    python -m benchmarks.cpu_pairs --out DIR                # → DIR/cpu_pairs_1.{md,json}, ...

The calibration table's goal is for a quiet 2-core CPU. On a machine with many idle cores
(a lent GPU machine's host, say) this measures the table in parts, each in its own
process pinned to two **physical** cores of its own (one logical CPU of each core, so no
two workers share a core's hyper-threads; no GPU: ``CUDA_VISIBLE_DEVICES`` is emptied),
the parts running side by side, and joins each replica's parts into one table
(:func:`benchmarks.calibration.merge`). With enough cores it measures ``--replicas``
whole tables at once, each an independent run. Each part sees two cores, as a 2-core
machine's process does (``os.sched_getaffinity``, torch's intra-op threads, ipukit's
pinning), and is calibrated and measured with its neighbours running: they share the
processor's last-level cache and memory bandwidth, which a 2-core machine has to itself.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

HERE = os.path.dirname(os.path.abspath(__file__))

# the table in parts of about equal time: the convnet's 13 rows take about as long as four
# of the ViT's, whose calibration alone is ~11 s a row on this project's 2-core VM
PARTS: Tuple[Tuple[str, str], ...] = (
    ("convnet", ""),
    ("vit", "sharded,gpipe"),
    ("vit", "1f1b,zb-h1"),
    ("vit", "interleaved-1f1b,looped-bfs,zbv,dualpipev"),
)


def physical_cores() -> List[List[int]]:
    """The logical CPUs this process may use, grouped by physical core (``lscpu -p``;
    each CPU its own core where lscpu is missing)."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        text = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [[c] for c in allowed]
    cores: Dict[Tuple[str, str], List[int]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        cpu, core, socket = (line.split(",") + ["", ""])[:3]
        if int(cpu) in allowed:
            cores.setdefault((socket, core), []).append(int(cpu))
    return sorted(cores.values())


def pairs(cores: List[List[int]], per: int = 2) -> List[List[int]]:
    """Sets of ``per`` physical cores, one logical CPU of each: what each part may use."""
    firsts = [c[0] for c in cores]
    return [firsts[i:i + per] for i in range(0, len(firsts) - per + 1, per)]


def plan(replicas: int) -> List[Tuple[int, int, str, str]]:
    """(replica, part, model, kinds) for each process, in the order they start."""
    return [(r, p, model, kinds) for r in range(replicas)
            for p, (model, kinds) in enumerate(PARTS)]


def pool(tables: List[Dict]) -> Dict:
    """Whole tables measured alike (replicas, runs), pooled row by row: each row's ratio the
    median over every table's rounds (3 rounds each: 12 from four tables, so one slow
    spell of the machine moves it less), its busy gap the furthest IPU's median measured
    share against the median of its modeled ranges (or values)."""
    import statistics as st

    rows = []
    for i, first in enumerate(tables[0]["rows"]):
        same = [t["rows"][i] for t in tables]
        if any((r["model"], r["config"]) != (first["model"], first["config"]) for r in same):
            raise ValueError("the tables' rows differ: pool only tables measured alike")
        ratios = [q for r in same for q in r["round_ratios"]]
        busy = [st.median(r["busy_measured"][k] for r in same)
                for k in range(len(first["busy_measured"]))]
        ranges = [(st.median((r["busy_range"] or [(b, b) for b in r["busy_modeled"]])[k][0]
                             for r in same),
                   st.median((r["busy_range"] or [(b, b) for b in r["busy_modeled"]])[k][1]
                             for r in same)) for k in range(len(busy))]
        gap = max(max(0.0, lo - m, m - hi) for m, (lo, hi) in zip(busy, ranges)) * 100
        rows.append({"model": first["model"], "config": first["config"],
                     "ratio": st.median(ratios), "low": min(ratios), "high": max(ratios),
                     "inside_rounds": sum(abs(q - 1) <= 0.15 for q in ratios),
                     "rounds": len(ratios),
                     "table_ratios": [r["ratio"] for r in same],
                     "busy_measured": busy, "busy_modeled": ranges, "busy_gap_points": gap})
    moved = [abs(b / a - 1) >= 0.15 for t in tables for r in t["rows"]
             for a, b in r.get("machine_ms") or [] if a > 0]
    return {"rows": rows, "tables": len(tables), "cpu": tables[0].get("cpu"),
            "cores": tables[0]["cores"], "torch": tables[0]["torch"],
            "moved": sum(moved), "rounds": len(moved)}


def pooled_report(result: Dict) -> str:
    rows = result["rows"]
    inside = [r for r in rows if abs(r["ratio"] - 1) <= 0.15]
    busy = [r for r in rows if r["busy_gap_points"] <= 10]
    both = [r for r in inside if r in busy]
    lines = [f"# The calibration table pooled over {result['tables']} tables measured alike "
             f"({result['cpu']}, {result['cores']} cores each, torch {result['torch']})", "",
             "Each row's ratio is the median of every table's rounds' ratios (model ÷ "
             "measured, each round modeled from its own calibration); the tables' own "
             "medians in brackets. Busy: each IPU's median measured share against the "
             "median of its modeled ranges (values where the model gives one).", "",
             "| model | configuration | model ÷ measured, pooled | rounds' lowest–highest "
             "| rounds within ±15 % | the tables' ratios | busy measured | busy modeled "
             "| busy gap (points) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['config']} | {r['ratio']:.2f}"
            f"{'' if abs(r['ratio'] - 1) <= 0.15 else ' ✗'} | {r['low']:.2f}–{r['high']:.2f} "
            f"| {r['inside_rounds']} of {r['rounds']} "
            f"| {', '.join(f'{q:.2f}' for q in r['table_ratios'])} "
            f"| {', '.join(f'{b:.0%}' for b in r['busy_measured'])} "
            f"| {', '.join(f'{lo:.0%}' if lo == hi else f'{lo:.0%}–{hi:.0%}' for lo, hi in r['busy_modeled'])} "
            f"| {r['busy_gap_points']:.0f}{'' if r['busy_gap_points'] <= 10 else ' ✗'} |")
    every = sum(r["inside_rounds"] for r in rows)
    total = sum(r["rounds"] for r in rows)
    lines += ["", f"Pooled: {len(inside)} of {len(rows)} rows within ±15 %, {len(busy)} within "
              f"±10 busy points, {len(both)} within both. Of single rounds, {every} of {total} "
              f"({every / total:.0%}) were within ±15 %. The machine's own speed (a fixed "
              f"one-thread job) moved 15 % or more between a calibration and its calls in "
              f"{result['moved']} of {result['rounds']} rounds.", ""]
    if result.get("sources"):
        lines += ["The tables: " + ", ".join(result["sources"]) + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--replicas", type=int, default=0,
                    help="whole tables measured at once (default: as many as the physical "
                         "cores give, at most 2)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--pool", nargs="+", metavar="JSON", default=None,
                    help="pool whole tables measured alike into --out/cpu_pairs.{md,json}")
    args = ap.parse_args(argv)
    if args.pool:
        from .common import read_results, write_result

        result = pool(read_results(args.pool))
        result["sources"] = [os.path.relpath(p, args.out) for p in args.pool]
        write_result(args.out, "cpu_pairs", result, pooled_report(result))
        return 0
    sets = pairs(physical_cores())
    replicas = args.replicas or max(1, min(2, len(sets) // len(PARTS)))
    jobs = plan(replicas)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    root = os.path.dirname(HERE)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                else "")
    print(f"{len(sets)} sets of 2 physical cores: {sets}; {replicas} replica(s) of "
          f"{len(PARTS)} parts", flush=True)
    pending = list(jobs)
    running: List[Tuple[subprocess.Popen, List[int], str]] = []
    free = list(sets)
    t0 = time.perf_counter()

    def stop(signum, frame):
        raise TimeoutError(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    failed = 0
    try:
        while pending or running:
            while pending and free:
                r, p, model, kinds = pending.pop(0)
                cpus = free.pop(0)
                out = os.path.join(args.out, f"r{r}p{p}")
                cmd = [sys.executable, "-m", "benchmarks.calibration", "--models", model,
                       "--out", out, "--rounds", str(args.rounds), "--calls", str(args.calls)]
                cmd += ["--kinds", kinds] if kinds else []
                cmd += ["--smoke"] if args.smoke else []
                with open(os.path.join(args.out, f"r{r}p{p}.log"), "w") as log:
                    proc = subprocess.Popen(
                        cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                        preexec_fn=lambda c=tuple(cpus): os.sched_setaffinity(0, c))
                print(f"[{time.perf_counter() - t0:6.1f} s] replica {r + 1} part {p + 1} "
                      f"({model} {kinds or 'all'}) on CPUs {cpus}", flush=True)
                running.append((proc, cpus, out))
            time.sleep(0.5)
            for item in list(running):
                proc, cpus, out = item
                if proc.poll() is not None:
                    running.remove(item)
                    free.append(cpus)
                    failed += proc.returncode != 0
                    print(f"[{time.perf_counter() - t0:6.1f} s] {out}: exit {proc.returncode}",
                          flush=True)
    except TimeoutError as stopped:
        print(f"[{time.perf_counter() - t0:6.1f} s] stopped ({stopped}): joining the parts "
              "that finished", flush=True)
        failed += 1
    finally:
        for proc, _, _ in running:
            proc.kill()
            proc.wait()
    from .calibration import merge, report
    from .common import read_results, write_result

    done: List[Dict] = []
    for r in range(replicas):
        paths = [os.path.join(args.out, f"r{r}p{p}", "calibration.json")
                 for p in range(len(PARTS))]
        parts = read_results(p for p in paths if os.path.exists(p))
        if parts:
            result = merge(parts)
            result["parts_missing"] = len(PARTS) - len(parts)
            write_result(args.out, f"cpu_pairs_{r + 1}", result, report(result))
            done.append(result)
    if len(done) > 1 and not any(t.get("parts_missing") for t in done):
        result = pool(done)
        write_result(args.out, "cpu_pairs", result, pooled_report(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
