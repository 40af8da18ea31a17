"""The benchmark suite runs end to end (tiny sizes) and writes both result files.

Benchmarks are not timed tests: this checks that every benchmark produces its
numbers, never what the numbers are.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_run_writes_results(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    sys.path.insert(0, REPO)
    from benchmarks.suite import BENCHMARKS

    assert set(data["results"]) == set(BENCHMARKS)
    for name, result in data["results"].items():
        assert "error" not in result["details"], (name, result["details"])
        if "skipped" in result["details"]:   # a peer or a torch this machine lacks: said why
            assert name in ("peers", "distributed") and result["details"]["skipped"], name
            continue
        values = [r["value"] for r in result["rows"]]
        assert values and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values), name
    machine = data["machine"]
    assert machine["cores"] >= 1 and len(machine["loadavg_end"]) == 3
    md = (out / "results.md").read_text()
    assert "| section | metric | value |" in md and "load average" in md
    assert f"torch {machine['torch']}" in md


def test_smoke_refuses_to_overwrite_the_real_results():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--out" in proc.stderr


def test_pipeline_win_measures_every_variant():
    """The 'pipeline wins' case (tiny sizes): five variants timed, two stages, a valid overlap.
    Its model and timing are the library's example (notebooks 01 and 03 use them)."""
    from ipukit.examples.recurrent import measure

    d = measure(hidden=8, length=3, micro_batch=2, micro_batches=4, rounds=2, per_round=1)
    variants = ("loop_1", "loop_2", "sharded_1", "sharded_2", "pipelined")
    assert all(d[v + "_s"] > 0 for v in variants)
    assert all(d["pipelined_over_" + v] > 0 for v in variants[:4])
    assert d["best_loop"] in variants[:2] and d["best_sharded"] in variants[2:4]
    assert len(d["stage_ms_1_thread"]) == len(d["stage_ms_2_threads"]) == 2
    assert sorted(d["timeline"].utilisation()["per_ipu"]) == [0, 1] and 0 <= d["overlap"] <= 1


def test_help_prints_every_option():
    """``--help`` renders (a bare % in an option's help once made argparse crash on it)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for option in ("--smoke", "--out", "--threads", "--wait-idle", "--only"):
        assert option in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "benchmarks.calibration", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(option in proc.stdout for option in ("--kinds", "--merge", "--quiet", "--bracket"))


def test_median_ratio_is_the_ratio_of_medians_with_a_bootstrap_noise():
    sys.path.insert(0, REPO)
    from benchmarks.common import median_ratio

    a = [1.0, 2.0, 3.0, 4.0, 100.0]
    b = [2.0, 4.0, 6.0, 8.0, 0.5]
    ratio, noise = median_ratio(a, b)
    assert ratio == 3.0 / 4.0
    assert noise > 0 and median_ratio(a, b) == (ratio, noise)  # seeded: reproducible
    assert median_ratio([1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]) == (0.5, 0.0)
    assert math.isnan(median_ratio([1.0], [2.0])[1])


def test_calibration_report_splits_each_ratio_into_passes_and_the_rest():
    from benchmarks.calibration import report

    def row(config, ratio, passes, rest, workers):
        return {"model": "m", "config": config, "kind": "1f1b", "workers": workers,
                "load": 0.5, "measured_ms": 100.0, "modeled_ms": 100.0 * ratio,
                "round_ms": [100.0], "round_ratios": [ratio], "spread": 0.0, "ratio": ratio,
                "model_vs_replay": passes, "replay_vs_measured": rest,
                "busy_measured": [0.5, 0.5], "busy_modeled": [0.5, 0.5], "busy_gap_points": 0}

    skewed = dict(row("d", 0.80, 0.98, 0.82, 4), mean_replay_vs_measured=0.93)
    text = report({"rows": [row("a", 0.70, 0.95, 0.74, 2), row("b", 1.30, 1.35, 0.96, 2),
                            row("c", 1.0, 1.0, 1.0, 2), skewed],
                   "tables": {}, "ga": 8, "di": 2, "calls": 3, "rounds": 1, "cores": 2,
                   "threads": 2, "torch": "x", "device": "CPU"})
    assert "| 0.70 ✗ (0.70) | 0.95 | 0.74 | — |" in text
    assert "| 0.80 ✗ (0.80) | 0.98 | 0.82 | 0.93 |" in text
    assert "replayed at their means they explain 93% of the call, at their medians 82%" in text
    assert text.count("passes were skewed") == 1   # d's alone
    assert "- m, a (ratio 0.70" in text and "mostly time outside the passes" in text
    assert "- m, b (ratio 1.30" in text and "the table modeled them at 1.35×" in text
    assert "- m, c (" not in text


def test_calibration_splits_each_rounds_error_along_the_critical_path():
    """Model and calls walked alike: passes 15 against 18.75 (0.80), the rest (host) 0.5
    against 1.0; the report's column and the row's cause say so."""
    import ipukit
    from benchmarks.calibration import path_split, report

    model = ipukit.simulate("gpipe", 2, 4, 1.0, 2.0, host_overhead=0.5)
    call = ipukit.simulate("gpipe", 2, 4, 1.25, 2.5, host_overhead=1.0)
    got = path_split([model, model], [call, call, call, call], calls=2)
    assert got["path_passes_ratio"] == pytest.approx(0.8)
    assert got["path_rest_ratio"] == pytest.approx(0.5)
    assert got["path_rest_share"] == pytest.approx(1.0 / 19.75)
    assert got["path_parts_measured_ms"]["host"] == pytest.approx(1e3)
    row = {"model": "m", "config": "g", "kind": "gpipe", "workers": 2, "load": 0.5,
           "measured_ms": 100.0, "modeled_ms": 78.0, "round_ms": [100.0],
           "round_ratios": [0.78], "spread": 0.0, "ratio": 0.78, "busy_measured": [0.5, 0.5],
           "busy_modeled": [0.5, 0.5], "busy_gap_points": 0, **got}
    text = report({"rows": [row], "tables": {}, "ga": 8, "di": 2, "calls": 2, "rounds": 2,
                   "cores": 2, "threads": 2, "torch": "x", "device": "CPU"})
    assert got["path_waited_share"] == 0.0    # each pass on the path follows its worker's
    assert "| 0.80, 0.50 (5 %; after a wait 0 %) |" in text
    assert "no pipelined row with 30 % or more" in text
    assert "1 pipelined row with under 10 % of the call in them, model ÷ measured 0.78" in text
    assert "on the critical path, its passes modeled at 0.80× the call's and the rest at " \
           "0.50×" in text
    assert "pipelined rows (1): the passes on the path modeled at a median 0.80×" in text


def test_waited_share_counts_the_path_passes_whose_worker_idled_first():
    """Stage 1's second forward (2.5-3.5 s) follows its worker's first after 0.5 s idle: it
    waited, 1 s of the 3.5 s call. Stage 0's passes run back to back, and a gap of a
    hand-off's size (100 µs) is no wait."""
    from benchmarks.calibration import waited_share
    from ipukit.timeline.events import Event, Timeline

    passes = [Event(0, "forward", 0, 0.0, 1.0, 0), Event(0, "forward", 1, 1.0, 2.0, 0),
              Event(1, "forward", 0, 1.0001, 2.0, 1)]
    tl = Timeline(passes + [Event(1, "forward", 1, 2.5, 3.5, 1)], meta={"kind": "gpipe"})
    assert waited_share(tl) == pytest.approx(1.0 / 3.5)
    soon = Timeline(passes + [Event(1, "forward", 1, 2.0001, 3.0, 1)], meta={"kind": "gpipe"})
    assert waited_share(soon) == 0.0
    # one worker runs a sharded call's stages in turn: IPU 1 idle while IPU 0 works is
    # that worker busy, not waiting
    sharded = Timeline([Event(0, "forward", 0, 0.0, 1.0, 0), Event(1, "forward", 0, 1.0, 2.0, 1),
                        Event(0, "forward", 1, 2.0, 3.0, 0), Event(1, "forward", 1, 3.0, 4.0, 1)],
                       meta={"kind": "sharded"})
    assert waited_share(sharded) == 0.0
    assert waited_share(Timeline(sharded.events, meta={"kind": "gpipe"})) == pytest.approx(0.5)


def test_calibration_sets_each_pipelined_rounds_ratio_beside_the_rate_of_two_passes():
    from benchmarks.calibration import _pair_summary

    rows = [{"kind": "gpipe", "pair_rate": [(2.0, 1.4), (2.0, 1.95), (1.5, 1.9)],
             "round_ratios": [1.3, 1.0, 0.8]},
            {"kind": "sharded", "pair_rate": [(2.0, 1.0)], "round_ratios": [0.5]}]
    text = _pair_summary(rows)
    assert "read 1.40–2.00 over the pipelined rounds" in text
    assert "fell by 15 % or more in 1 (their ratios' median 1.30, 1 outside ±15 %)" in text
    assert "rose as much in 1 (their ratios' median 0.80, 1 outside ±15 %)" in text
    assert "held in 1 (their ratios' median 1.00, 0 outside ±15 %)" in text
    assert _pair_summary([{"kind": "gpipe", "round_ratios": [1.0]}]) == ""


def test_calibration_bracket_models_each_table_alone_and_their_mean():
    """--bracket: each round calibrated again after its calls; the summary counts the rows
    modeled from each table alone and from their mean, and how far the two lay apart."""
    from benchmarks.calibration import _bracket_summary

    rows = [{"round_ms": [100.0, 100.0], "bracketed_ms": [(80.0, 120.0), (70.0, 105.0)],
             "ratio": 1.0},
            {"round_ms": [50.0], "bracketed_ms": [(50.0, 50.0)], "ratio": 1.0},
            {"round_ms": [10.0], "ratio": 1.0}]             # not bracketed: left out
    text = _bracket_summary(rows)
    assert "before the calls alone, 1 of 2 rows within ±15 %" in text   # 0.75: out, 1.0
    assert "after alone, 2; from their mean, 2" in text                 # 1.125 and 1.0
    # apart: |120/80 − 1| = 50 %, |105/70 − 1| = 50 %, 0 %: median 50 %
    assert "lay a median 50% apart" in text
    assert _bracket_summary([{"round_ms": [1.0], "ratio": 1.0}]) == ""


def test_calibration_bracketed_run_records_both_tables(tmp_path):
    from benchmarks.calibration import run

    result = run(models=("convnet",), calls=1, rounds=1, smoke=True, kinds=["gpipe"],
                 bracket=True)
    assert result["bracket"] is True
    for row in result["rows"]:
        (before, after), = row["bracketed_ms"]
        assert before > 0 and after > 0 and row["modeled_ms"] > 0


def test_calibration_report_gives_the_rounds_own_spread_measured_and_modeled():
    """Each round calibrates afresh: the report says how much the measured call and the
    model moved from round to round (the median over rows of max − min over the median)."""
    from benchmarks.calibration import _noise_summary

    rows = [{"round_ms": [100.0, 110.0, 90.0], "round_ratios": [1.0, 1.0, 1.0]},
            {"round_ms": [50.0, 50.0, 50.0], "round_ratios": [0.8, 1.0, 1.2]},
            {"round_ms": [10.0], "round_ratios": [1.0]}]   # one round: no spread
    text = _noise_summary(rows)
    # measured: 20 % and 0 % -> median 10 %; modeled: 20 % and 40 % -> 30 %
    assert "measured 10%, modeled 30%" in text
    assert _noise_summary([{"round_ms": [1.0], "round_ratios": [1.0]}]) == ""


def test_calibration_pool_pools_the_tables_rounds_row_by_row():
    """--pool: each row's median over every table's rounds; the bias (the side rows miss on
    in every table) apart from the noise (misses both ways)."""
    from benchmarks.calibration import pooled

    def table(ratios_a, ratios_b, gap=2.0):
        def row(config, kind, rounds):
            return {"model": "m", "config": config, "kind": kind, "ratio": sorted(rounds)[1],
                    "round_ratios": rounds, "busy_gap_points": gap}
        return {"rows": [row("a", "sharded", ratios_a), row("b", "1f1b", ratios_b)]}

    text = pooled([table([0.7, 1.0, 1.3], [0.80, 0.82, 0.84]),
                   table([1.3, 1.0, 0.7], [0.86, 0.80, 0.90], gap=20.0)], ["x", "y"])
    assert "| m | a | 6 | 1.00 | 1.00 | 1.00 | 11 |" in text
    assert "| m | b | 6 | 0.83 ✗ | 0.82 | 0.86 | 11 |" in text
    assert "Pooled: 1 of 2 rows within ±15 %, 0 within ±15 % and ±10 busy points" in text
    assert "pipelined: 1 of 1 rows below 1 (0.83–0.83)" in text


def test_calibration_names_a_flip_of_the_two_threads_gain_on_a_one_worker_row():
    import torch
    from benchmarks.calibration import _cause, _seconds, machine_ms, thread_gain

    one = {"model": "m", "config": "sharded, 1 IPU", "kind": "sharded", "workers": 1,
           "ratio": 0.72, "model_vs_replay": 0.73, "replay_vs_measured": 0.98}
    flipped = _cause(dict(one, thread_gain=[(1.65, 1.15), (1.64, 1.66)]), 2)
    assert "in 1 of 2 rounds (1.65 → 1.15)" in flipped and "spells" in flipped
    slower = _cause(dict(one, thread_gain=[(1.65, 1.60)],
                         machine_ms=[(10.0, 13.0), (10, 10.5)]), 2)
    assert "own speed moved between the calibration and the calls in 1 of 2 rounds" in slower
    assert "10.0 → 13.0 ms" in slower
    again = _cause(dict(one, retried=[(10.0, 14.0)], machine_ms=[(10.0, 10.4)]), 2,
                   quiet=True)
    assert "measured again in 1 rounds whose machine speed moved (10.0 → 14.0 ms)" in again
    assert "own speed moved" not in again
    # without --quiet no round is measured again, whatever an older run recorded
    assert "measured again" not in _cause(dict(one, retried=[(10.0, 14.0)]), 2)
    steady = _cause(dict(one, thread_gain=[(1.65, 1.60)]), 2)
    assert "spells" not in steady and "the machine's speed" in steady
    assert _seconds([2.0, 1.5]) == "2.00, 1.50 s"
    assert _seconds([2.0, 1.5, 1.75, 1.6]) == ("2.00 s the first, then 1.50–1.75 s "
                                               "(median 1.60) over 3 more")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert thread_gain(repeats=1) == 1.0        # one thread has nothing to gain
        assert machine_ms(repeats=1) > 0
        torch.set_num_threads(2)
        assert thread_gain(repeats=1) > 0 and torch.get_num_threads() == 2   # restored
    finally:
        torch.set_num_threads(threads)


def test_busy_gap_is_measured_against_the_modeled_range_where_there_is_one():
    from benchmarks.calibration import _gap_points, _modeled_busy

    # a share inside its range is 0 points off; outside, the distance to the nearer end
    assert _gap_points([0.5, 0.3], [(0.4, 0.6), (0.35, 0.5)]) == pytest.approx(5.0)
    assert _gap_points([0.5, 0.3], [(0.5, 0.5), (0.3, 0.3)]) == 0.0
    assert _gap_points([0.5], [(0.4, 0.6), (0.1, 0.2)]) is None
    assert _modeled_busy({"busy_range": [(0.4, 0.6)], "busy_modeled": [0.6]}) == "40%–60%"
    assert _modeled_busy({"busy_range": None, "busy_modeled": [0.6, 0.25]}) == "60%, 25%"


def test_the_calibration_benchmark_waits_for_the_machines_own_speed(monkeypatch):
    import benchmarks.calibration as cal

    readings = iter([20.0, 13.0, 11.5, 9.0])
    monkeypatch.setattr(cal, "machine_ms", lambda repeats=5: next(readings))
    monkeypatch.setattr(cal.time, "sleep", lambda s: None)
    fastest = [10.0]
    cal.wait_for_speed(fastest, within=1.2)           # 20 and 13 too slow; 11.5 ≤ 12
    assert next(readings) == 9.0 and fastest == [10.0]
    fastest = [float("inf")]
    monkeypatch.setattr(cal, "machine_ms", lambda repeats=5: 30.0)
    cal.wait_for_speed(fastest)                       # the first reading is the fastest
    assert fastest == [30.0]
    rows = [{"machine_ms": [(10.0, 11.0)], "retried": [(10.0, 14.0)], "waited_s": 4.0},
            {"machine_ms": [(12.0, 12.5), (10.0, 12.0)]}]
    text = cal._quiet_summary({"rows": rows, "quiet": True})
    assert "read 10.0–12.5 ms" in text and "1 rounds were measured again" in text
    assert "in 1 of 3 rounds kept" in text and "waited 4 s in all" in text
    text = cal._quiet_summary({"rows": rows})
    assert "measured again" not in text and "--quiet waits for it" in text


def test_the_table_measured_in_parts_on_separate_cores_joins_into_one():
    from benchmarks.calibration import merge, report

    def row(model, kind, config, workers=2):
        return {"model": model, "kind": kind, "config": config, "workers": workers,
                "ratio": 1.0, "measured_ms": 10.0, "modeled_ms": 10.0, "busy_measured": [0.5],
                "busy_modeled": [0.5], "busy_range": None, "busy_gap_points": 0.0}

    def part(rows, load, tables):
        return {"rows": rows, "load": [load, 0, 0], "tables": tables, "ga": 8, "di": 2,
                "calls": 3, "rounds": 3, "per_row": True, "cores": 2, "threads": 2,
                "device": "CPU", "torch": "x", "cpu": "Some CPU"}

    vit_b = part([row("vit", "zbv", "zbv, 2 IPUs × 2 stages"),
                  row("vit", "1f1b", "1f1b, 2 IPUs")], 3.0, {"vit": {"b": 1}})
    conv = part([row("convnet", "sharded", "sharded, 1 IPU", 1)], 1.0, {"convnet": {"c": 1}})
    vit_a = part([row("vit", "sharded", "sharded, 2 IPUs", 1)], 2.0, {"vit": {"a": 1}})
    joined = merge([vit_b, conv, vit_a])
    assert [r["config"] for r in joined["rows"]] == [
        "sharded, 1 IPU", "sharded, 2 IPUs", "1f1b, 2 IPUs", "zbv, 2 IPUs × 2 stages"]
    assert joined["tables"] == {"vit": {"b": 1}, "convnet": {"c": 1}}   # each model's first
    assert joined["load"][0] == 3.0 and joined["parts"] == 3
    text = report(dict(joined, tables={}))
    assert "processor: Some CPU" in text and "measured in 3 parts side by side" in text
    with pytest.raises(ValueError, match="differ in threads"):
        merge([conv, dict(vit_a, threads=1)])


def test_a_benchmark_that_cannot_run_here_is_skipped_with_its_reason(monkeypatch):
    """An optional peer not installed, or a torch too old for the process runtime: the
    benchmark's row says so and the run does not fail (a GPU machine has torch 2.11)."""
    sys.path.insert(0, REPO)
    from benchmarks import suite
    from benchmarks.common import SMOKE
    import ipukit.runtime.processes.group as group

    monkeypatch.setattr(group, "torch_release", lambda: (2, 11))
    out = suite.run_one("distributed", SMOKE)
    assert out["details"] == {"skipped": out["rows"][0]["note"]}
    assert "needs torch 2.14 or later" in out["details"]["skipped"]
    assert out["rows"][0]["metric"] == "skipped"
