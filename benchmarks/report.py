"""results.md (a table per section, goals beside values) and results.json."""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List

PROVISIONAL = ("Provisional: measured on a machine whose cores are shared with other work "
               "(see the load averages); ratios come from interleaved runs, absolute times "
               "drift with the load.")


def _fmt(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def _verdict(r: dict) -> str:
    if r["goal"] is None:
        return ""
    if r["met"] is None:
        return "inconclusive (see notes)"
    return "met" if r["met"] else "**missed**"


def markdown(results: Dict[str, dict], info: dict) -> str:
    """The results as Markdown: machine facts, then one table row per measured number."""
    lines = ["# ipukit benchmark results", "", f"_{PROVISIONAL}_", "",
             f"- mode: {info['mode']}; command: `{info['command']}`",
             f"- cores: {info['cores']}; main-thread intra-op threads: {info['torch_threads']}; "
             f"torch {info['torch']}; Python {info['python']}; CPU: {info['cpu']}",
             f"- load average (1, 5, 15 min) at start: {_load(info['loadavg_start'])}; "
             f"at end: {_load(info['loadavg_end'])}",
             f"- date: {info['date']}; total {info['seconds']:.0f} s", "",
             "| section | metric | value | unit | goal | verdict | notes |",
             "|---|---|---:|---|---|---|---|"]
    for name, out in results.items():
        for r in out["rows"]:
            lines.append(f"| {r['section']} | {r['metric']} | {_fmt(r['value'])} | {r['unit']} | "
                         f"{r['goal'] or ''} | {_verdict(r)} | {r['note']} |")
    lines += ["", "Per benchmark (the load each one ran under):", "",
              "| benchmark | seconds | load at start, end (1 min) | CPUs idle just before |",
              "|---|---:|---|---:|"]
    for name, out in results.items():
        start, end = out.get("loadavg_start"), out.get("loadavg_end")
        idle = out.get("idle_share")
        lines.append(f"| {name} | {out.get('seconds', float('nan')):.0f} | "
                     + (f"{start[0]:.2f}, {end[0]:.2f}" if start and end else "—") + " | "
                     + (f"{idle:.0%}" if idle is not None else "—") + " |")
    lines.append("")
    return "\n".join(lines)


def _load(values: List[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def write(results: Dict[str, dict], info: dict, directory: str) -> List[str]:
    """Write results.md and results.json into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    md = os.path.join(directory, "results.md")
    js = os.path.join(directory, "results.json")
    with open(md, "w") as f:
        f.write(markdown(results, info))
    with open(js, "w") as f:
        json.dump({"machine": info, "results": results}, f, indent=1, default=_plain)
    return [md, js]


def _plain(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return repr(value)
