"""Run the benchmark suite and write results.md and results.json.

    .venv/bin/python -m benchmarks.run            # full run (minutes) → benchmarks/results.*
    .venv/bin/python -m benchmarks.run --smoke --out /tmp/bench   # seconds, tiny sizes
    .venv/bin/python -m benchmarks.run --only overhead,recording
    .venv/bin/python -m benchmarks.run --wait-idle 600   # each benchmark waits for quiet CPUs

Every benchmark runs in this one process (the torch.distributed peer starts
its own processes), one after another, so all numbers share one machine
state; the load average is recorded at the start and end.

The main thread runs with ``--threads`` intra-op threads (default 1), and
ipukit's pipeline workers with their default (cores ÷ workers). One thread
keeps a busy neighbour from stalling every multi-threaded op at its OpenMP
barrier; variants that can only use the cores through intra-op threads
(sharded execution, torchgpipe on CPU) are also run with every core.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import List, Optional, Sequence

if __package__ in (None, ""):  # run as a file: python benchmarks/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import torch  # noqa: E402

from benchmarks import report  # noqa: E402
from benchmarks.common import FULL, SMOKE, as_dict, machine  # noqa: E402
from benchmarks.suite import BENCHMARKS, run_one  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
IDLE, WINDOW = 0.9, 5.0


def _cpu_times() -> Optional[List[int]]:
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):  # not Linux
        return None


def idle_share(window: float = WINDOW) -> Optional[float]:
    """Share of all CPUs' time that was idle over the next ``window`` seconds (Linux)."""
    a = _cpu_times()
    time.sleep(window)
    b = _cpu_times()
    if a is None or b is None:
        return None
    delta = [y - x for x, y in zip(a, b)]
    total = sum(delta[:8])  # user nice system idle iowait irq softirq steal
    return (delta[3] + delta[4]) / total if total else None


def wait_for_idle(limit: float) -> dict:
    """Wait up to ``limit`` seconds for a quiet window; returns what was found and waited."""
    start = time.perf_counter()
    share = idle_share()
    while share is not None and share < IDLE and time.perf_counter() - start < limit:
        share = idle_share()
    return {"idle_share": share, "waited_s": time.perf_counter() - start}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds per benchmark")
    p.add_argument("--out", default=None,
                   help="output folder (default: benchmarks/ for full runs; required with --smoke)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of the main thread (sharded, single-stage and plain "
                   "PyTorch steps, the optimiser step); default 1, see benchmarks/README.md")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each benchmark, wait up to SECONDS for the CPUs to be at least "
                   f"{IDLE:.0%}% idle over {WINDOW:.0f} s (a machine shared with other work); "
                   "what it found is recorded with the benchmark")
    p.add_argument("--only", default=None,
                   help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    args = p.parse_args(argv)
    if args.smoke and args.out is None:
        p.error("--smoke writes to a scratch folder: give --out DIR (never over results.md)")
    return args


def selected(only: Optional[str]) -> List[str]:
    if not only:
        return list(BENCHMARKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    return names


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    torch.set_num_threads(args.threads)
    info = machine()
    info.update(mode="smoke" if args.smoke else "full", sizes=as_dict(sizes),
                command="python -m benchmarks.run " + " ".join(argv if argv is not None
                                                               else sys.argv[1:]))
    start = time.perf_counter()
    results = {}
    for name in selected(args.only):
        quiet = wait_for_idle(args.wait_idle) if args.wait_idle > 0 else {}
        print(f"[bench] {name} ...", flush=True)
        # each benchmark starts as if alone: the documented thread count, and no garbage
        # an earlier one left for the collector to walk during its timed calls
        torch.set_num_threads(args.threads)
        gc.collect()
        load = list(os.getloadavg())
        results[name] = run_one(name, sizes)
        results[name].update(quiet, loadavg_start=load, loadavg_end=list(os.getloadavg()))
        print(f"[bench] {name}: {results[name]['seconds']:.1f} s", flush=True)
    info.update(seconds=time.perf_counter() - start, loadavg_end=list(os.getloadavg()))
    paths = report.write(results, info, args.out or HERE)
    print(report.markdown(results, info))
    print("wrote " + ", ".join(paths))
    failed = [n for n, r in results.items() if "error" in r["details"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
