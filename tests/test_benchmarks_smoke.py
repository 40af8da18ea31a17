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


def test_smoke_refuses_to_overwrite_the_real_results(capsys):
    sys.path.insert(0, REPO)
    from benchmarks import run

    with pytest.raises(SystemExit) as exit:
        run.main(["--smoke"])
    assert exit.value.code == 2 and "--out" in capsys.readouterr().err


def test_pipeline_win_measures_every_variant():
    """The 'pipeline wins' case (tiny sizes): five variants timed, two stages, a valid overlap.
    Its model is the library's example, its timing notebook 03's (notebooks/lessons.py)."""
    from lessons import measure

    d = measure(hidden=8, length=3, micro_batch=2, micro_batches=4, rounds=2, per_round=1)
    variants = ("loop_1", "loop_2", "sharded_1", "sharded_2", "pipelined")
    assert all(d[v + "_s"] > 0 for v in variants)
    assert all(d["pipelined_over_" + v] > 0 for v in variants[:4])
    assert d["best_loop"] in variants[:2] and d["best_sharded"] in variants[2:4]
    assert len(d["stage_ms_1_thread"]) == len(d["stage_ms_2_threads"]) == 2
    assert sorted(d["timeline"].utilisation()["per_ipu"]) == [0, 1] and 0 <= d["overlap"] <= 1


def test_help_prints_every_option(capsys):
    """``--help`` renders (a bare % in an option's help once made argparse crash on it)."""
    sys.path.insert(0, REPO)
    from benchmarks import calibration, run

    for main, options in ((run.main, ("--smoke", "--out", "--threads", "--wait-idle", "--only")),
                          (calibration.main, ("--smoke", "--rounds", "--pool"))):
        with pytest.raises(SystemExit) as exit:
            main(["--help"])
        assert exit.value.code == 0
        out = capsys.readouterr().out
        assert all(option in out for option in options), out


def test_the_calibration_benchmark_smoke_run_writes_its_report(tmp_path):
    from benchmarks.calibration import main

    assert main(["--smoke", "--models", "convnet", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert len(data["rows"]) == 3 and all(r["measured_ms"] > 0 for r in data["rows"])
    text = (tmp_path / "calibration.md").read_text()
    assert "python -m benchmarks.calibration --smoke" in text and data["commit"] in text


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


def _rows():
    return [{"model": "m", "config": c, "kind": k, "measured_ms": w, "modeled_ms": m,
             "ratio": m / w, "uncertain": []}
            for c, k, w, m in (("sharded, 1 IPU", "sharded", 100.0, 100.0),
                               ("gpipe, 2 IPUs", "gpipe", 70.0, 60.0),
                               ("1f1b, 2 IPUs", "1f1b", 60.0, 65.0),
                               ("zb-h1, 2 IPUs", "zb-h1", 59.0, 50.0))]


def test_the_calibration_report_gives_each_rows_bias_the_pipelined_median_and_the_pairs():
    from benchmarks.calibration import ordered_pairs, report, summary

    rows = _rows()
    # measured 20 % apart or more: sharded against each pipeline (3 pairs), and gpipe
    # against none (70 vs 60 and 59 are closer); the model orders all three as measured
    assert ordered_pairs(rows) == {"pairs": 3, "ordered": 3}
    s = summary(rows)
    assert s["pipelined_median"] == pytest.approx(60 / 70)
    assert s["sharded_median"] == 1.0
    text = report({"rows": rows, "rounds": 3, "commit": "abc1234"}, "python -m x")
    assert "`python -m x`" in text and "abc1234" in text
    assert "0.86" in text and "3 of 3" in text
    wrong = [dict(r, modeled_ms=200.0) if r["kind"] == "1f1b" else r for r in rows]
    assert ordered_pairs(wrong) == {"pairs": 3, "ordered": 2}


def test_the_calibration_pool_takes_each_rows_median_over_runs():
    from benchmarks.calibration import pool

    runs = [{"rows": [dict(r, ratio=r["ratio"] * f) for r in _rows()], "rounds": 3}
            for f in (0.9, 1.0, 1.2)]
    pooled = pool(runs)
    assert pooled["runs"] == 3 and pooled["rounds"] == 9
    assert [r["ratio"] for r in pooled["rows"]] == pytest.approx([r["ratio"] for r in _rows()])


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
