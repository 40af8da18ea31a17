"""The calibrated schedule model against the measurement, configuration by configuration.

    .venv/bin/python -m benchmarks.calibration                 # → benchmarks/calibration.md / .json
    .venv/bin/python -m benchmarks.calibration --smoke --out /tmp/bench
    .venv/bin/python -m benchmarks.calibration --pool a.json b.json ...   # → calibration_pooled.md

For the tutorial convnet (4 blocks, micro-batch 40) and the example ViT (8 encoder layers
as blocks, micro-batch 32), each round calibrates a fresh cost table
(:func:`ipukit.calibrate`, guarded), then **measures** every configuration below (a freshly
built model, a warm-up call, the median of ``calls`` calls) and **models** it from that
round's table alone (:func:`ipukit.timeline.costs.model_call`):

- sharded on 1, 2 and 4 IPUs;
- GPipe, 1F1B and ZB-H1 on 2 and 4 IPUs (one stage per IPU, an even split of the blocks);
- interleaved 1F1B, looped BFS, ZBV and DualPipeV on 2 IPUs (four stages, two per IPU).

Every configuration runs with ``cpuThreadsPerIpu(table.threads)``, the thread count the
table was measured at, so sharded and pipelined compare like with like. A row's ratio is
the median over rounds of modeled ÷ measured; the report gives each row's ratio, the
pipelined rows' median, and how many pairs of configurations whose measured times differ
by 20 % or more the model orders the way they measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from itertools import combinations
from typing import Dict, List, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import torch  # noqa: E402

import ipukit  # noqa: E402
from ipukit.balance import discover_blocks  # noqa: E402
from ipukit.calibrate import calibrate, even_split, model_call  # noqa: E402
from ipukit.schedules import placement  # noqa: E402
from ipukit.timeline.simulate import available_cores  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
#: pairs of configurations this far apart, measured, are the ones the model must order
PAIR_GAP = 0.20


def _convnet():
    from ipukit.examples.mnist import Network, TrainingModelWithLoss

    return TrainingModelWithLoss(Network()), 40


def _vit():
    from ipukit.examples.vit import ViT
    from ipukit.ipuconfig import IPUConfig

    vit = ViT(num_layers=8)
    vit.parallelize(IPUConfig(layers_per_ipu=[1] * 8, ipus_per_replica=8))
    return vit, 32


MODELS = {"convnet": _convnet, "vit": _vit}


def configs(blocks: List[str]):
    """(label, kind, stage blocks, stage IPUs) of every configuration measured."""
    out = []
    for p in (1, 2, 4):
        if p <= len(blocks):
            out.append((f"sharded, {p} IPU{'s' * (p > 1)}", "sharded", even_split(blocks, p),
                        list(range(p))))
    for kind in ("gpipe", "1f1b", "zb-h1"):
        for p in (2, 4):
            if p <= len(blocks):
                out.append((f"{kind}, {p} IPUs", kind, even_split(blocks, p), list(range(p))))
    for kind in ("interleaved-1f1b", "looped-bfs", "zbv", "dualpipev"):
        if len(blocks) >= 4:
            out.append((f"{kind}, 2 IPUs × 2 stages", kind, even_split(blocks, 4),
                        placement(kind, 4, 2)))
    return out


def setup(name: str, ga: int, di: int):
    """``name``'s model (seeded), one micro-batch, its blocks, and a call's data."""
    torch.manual_seed(0)
    net, mb = MODELS[name]()
    x = torch.randn(mb, 1, 28, 28)
    y = torch.randint(0, 10, (mb,))
    blocks = discover_blocks(net, (x, y))
    n = mb * ga * di
    return net, (x, y), blocks, (torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))


def _options(kind: str, stages, ipus, ga: int, di: int, threads: int) -> ipukit.Options:
    opts = ipukit.Options().deviceIterations(di).cpuThreadsPerIpu(threads)
    opts.Training.gradientAccumulation(ga)
    cls = ipukit.ShardedExecution if kind == "sharded" else ipukit.PipelinedExecution
    opts.setExecutionStrategy(cls(*[ipukit.Stage(*names).ipu(ipu)
                                    for names, ipu in zip(stages, ipus)]))
    if kind != "sharded":
        opts.pipelineSchedule(kind)
    return opts


def _timed(net, options, X, Y, calls: int) -> float:
    """The median wall time of ``calls`` calls of a fresh training model, after a warm-up."""
    model = ipukit.trainingModel(net, options,
                                 optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4))
    try:
        model(X, Y)
        walls = []
        for _ in range(calls):
            model(X, Y)
            walls.append(model.getTimeline().wall_time)
        return statistics.median(walls)
    finally:
        model.destroy()


def run(models: Sequence[str] = ("convnet", "vit"), ga: int = 8, di: int = 2, calls: int = 3,
        rounds: int = 3, smoke: bool = False) -> Dict:
    """Every configuration measured and modeled in ``rounds`` rounds, each round from a
    table calibrated at its start (see the module docstring)."""
    rows = []
    tables = {}
    for name in models:
        net, sample, blocks, (X, Y) = setup(name, ga, di)
        chosen = configs(blocks)[: 3 if smoke else None]
        measured: List[List[float]] = [[] for _ in chosen]
        modeled: List[List[float]] = [[] for _ in chosen]
        uncertain: List[str] = []
        for _ in range(rounds):
            table = calibrate(net, sample, blocks, cache=False,
                              optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4))
            tables.setdefault(name, table.to_dict())
            uncertain += table.uncertain
            for i, (label, kind, stages, ipus) in enumerate(chosen):
                measured[i].append(_timed(net, _options(kind, stages, ipus, ga, di,
                                                        table.threads), X, Y, calls))
                modeled[i].append(model_call(table, kind, stages, ga, iterations=di,
                                             stage_ipus=ipus).wall_time)
        for i, (label, kind, stages, ipus) in enumerate(chosen):
            ratios = [m / w for m, w in zip(modeled[i], measured[i])]
            rows.append({"model": name, "config": label, "kind": kind,
                         "measured_ms": statistics.median(measured[i]) * 1e3,
                         "modeled_ms": statistics.median(modeled[i]) * 1e3,
                         "ratio": statistics.median(ratios), "round_ratios": ratios,
                         "uncertain": sorted(set(uncertain))})
            r = rows[-1]
            print(f"{name:8s} {label:32s} measured {r['measured_ms']:8.1f} ms  modeled "
                  f"{r['modeled_ms']:8.1f} ms  ratio {r['ratio']:.2f}", flush=True)
    return {"rows": rows, "tables": tables, "ga": ga, "di": di, "calls": calls,
            "rounds": rounds, "cores": available_cores(), "torch": torch.__version__}


def ordered_pairs(rows: List[Dict], gap: float = PAIR_GAP) -> Dict[str, int]:
    """Pairs of one model's configurations whose measured times differ by ``gap`` or more:
    how many there are, and how many the model orders the way they measured."""
    total = right = 0
    for a, b in combinations(rows, 2):
        if a["model"] != b["model"]:
            continue
        lo, hi = sorted((a["measured_ms"], b["measured_ms"]))
        if hi < (1 + gap) * lo:
            continue
        total += 1
        right += (a["measured_ms"] < b["measured_ms"]) == (a["modeled_ms"] < b["modeled_ms"])
    return {"pairs": total, "ordered": right}


def summary(rows: List[Dict]) -> Dict[str, float]:
    """The pipelined rows' median ratio and spread, the sharded rows', and the pairs."""
    piped = [r["ratio"] for r in rows if r["kind"] != "sharded"]
    sharded = [r["ratio"] for r in rows if r["kind"] == "sharded"]
    out = dict(ordered_pairs(rows))
    if piped:
        out.update(pipelined_median=statistics.median(piped), pipelined_min=min(piped),
                   pipelined_max=max(piped))
    if sharded:
        out["sharded_median"] = statistics.median(sharded)
    out["within_10"] = sum(abs(r["ratio"] - 1) <= 0.10 for r in rows)
    out["rows"] = len(rows)
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(result: Dict, command: str) -> str:
    """The Markdown report: the command and commit, each row, and the summary."""
    rows = result["rows"]
    s = summary(rows)
    lines = ["# The calibrated model against the measurement",
             "", f"Command: `{command}` · commit `{result.get('commit', _commit())}` · "
             f"{result.get('rounds', '?')} rounds · torch {result.get('torch', '?')} · "
             f"{result.get('cores', '?')} cores", "",
             "| model | configuration | measured ms | modeled ms | modeled ÷ measured |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['config']} | {r['measured_ms']:.1f} | "
              f"{r['modeled_ms']:.1f} | {r['ratio']:.2f} |" for r in rows]
    lines += ["", "## Summary", ""]
    if "pipelined_median" in s:
        lines.append(f"- Pipelined rows: modeled ÷ measured a median {s['pipelined_median']:.2f} "
                     f"({s['pipelined_min']:.2f}–{s['pipelined_max']:.2f}); a pipelined call "
                     f"takes about {1 / s['pipelined_median'] - 1:.0%} longer than modeled.")
    if "sharded_median" in s:
        lines.append(f"- Sharded rows: a median {s['sharded_median']:.2f}.")
    lines.append(f"- Rows within ±10 %: {s['within_10']} of {s['rows']}.")
    if s["pairs"]:
        lines.append(f"- Pairs measured {PAIR_GAP:.0%} or more apart that the model orders "
                     f"as measured: {s['ordered']} of {s['pairs']} "
                     f"({s['ordered'] / s['pairs']:.0%}).")
    marked = sorted({u for r in rows for u in r.get("uncertain", [])})
    if marked:
        lines.append("- Tables marked uncertain: " + "; ".join(marked) + ".")
    return "\n".join(lines) + "\n"


def pool(results: List[Dict]) -> Dict:
    """Several runs as one: each row's ratio the median of the runs' ratios (and its
    measured and modeled times the medians), the rows matched by model and configuration."""
    by: Dict[tuple, List[Dict]] = {}
    for res in results:
        for r in res["rows"]:
            by.setdefault((r["model"], r["config"]), []).append(r)
    rows = [{"model": m, "config": c, "kind": rs[0]["kind"],
             "measured_ms": statistics.median(r["measured_ms"] for r in rs),
             "modeled_ms": statistics.median(r["modeled_ms"] for r in rs),
             "ratio": statistics.median(r["ratio"] for r in rs),
             "runs": [r["ratio"] for r in rs],
             "uncertain": sorted({u for r in rs for u in r.get("uncertain", [])})}
            for (m, c), rs in by.items()]
    first = results[0] if results else {}
    return {"rows": rows, "runs": len(results), "rounds": sum(r.get("rounds", 0)
                                                               for r in results),
            "torch": first.get("torch"), "cores": first.get("cores"),
            "commit": first.get("commit")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="three configurations, one round")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--models", default="convnet,vit")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per configuration")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every configuration")
    ap.add_argument("--pool", nargs="+", metavar="JSON", help="pool earlier runs' JSON")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    command = "python -m benchmarks.calibration " + " ".join(argv if argv is not None
                                                             else sys.argv[1:])
    if args.pool:
        results = [json.load(open(p)) for p in args.pool]
        pooled = pool(results)
        with open(os.path.join(args.out, "calibration_pooled.md"), "w") as f:
            f.write(report(pooled, command))
        print(report(pooled, command))
        return 0
    result = run(args.models.split(","), calls=1 if args.smoke else args.calls,
                 rounds=1 if args.smoke else args.rounds, smoke=args.smoke)
    result["commit"] = _commit()
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = report(result, command)
    with open(os.path.join(args.out, "calibration.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
