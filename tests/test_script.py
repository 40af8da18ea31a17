"""The training script (``ipukit-mnist``): real runs, clear errors, profiles.

The quick runs use a few thousand real MNIST samples so they finish in
seconds; the slow test trains two full epochs with the tutorial's defaults
(opt in with ``IPUKIT_SLOW=1 pytest -m slow``).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from ipukit.examples import mnist_pipeline

ACCURACY_LINE = re.compile(r"^Accuracy on test set: (\d+\.\d\d)%$")
QUICK = ["--epochs", "1", "--device-iterations", "4", "--gradient-accumulation", "8",
         "--limit-train", "6400", "--limit-test", "1024"]


def run_script(args, data_root, timeout=300):
    """Run ``python -m ipukit.examples.mnist_pipeline`` as a user would."""
    env = dict(os.environ, IPUKIT_DATA=data_root)
    return subprocess.run([sys.executable, "-m", "ipukit.examples.mnist_pipeline", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def final_accuracy(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    match = ACCURACY_LINE.match(last)
    assert match, f"last line is not the accuracy line: {last!r}"
    return float(match.group(1))


def test_quick_real_run_prints_accuracy_last(data_root):
    proc = run_script(QUICK, data_root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # 20 AdamW steps on 6400 samples: well above chance (10%), far from converged.
    final = final_accuracy(proc.stdout)
    assert 50.0 < final <= 100.0
    # the test bar's running mean: a real mean at every call, ending at the printed result
    shown = [float(v) for v in re.findall(r"accuracy=([\d.]+)%", proc.stderr)]
    assert shown and all(0.0 <= v <= 100.0 for v in shown), shown
    assert abs(shown[-1] - final) < 0.006, (shown[-1], final)


def test_too_few_accumulation_steps_is_one_clear_line(data_root):
    proc = run_script(["--gradient-accumulation", "3", "--limit-train", "4000",
                       "--limit-test", "800"], data_root)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert "gradientAccumulation" in errors[0] and "(7)" in errors[0] and "got 3" in errors[0]


def test_debug_shows_the_traceback(data_root):
    proc = run_script(["--debug", "--gradient-accumulation", "3", "--limit-train", "4000",
                       "--limit-test", "800"], data_root)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "PipelineConfigError" in proc.stderr


def test_console_script_is_installed():
    script = shutil.which("ipukit-mnist", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("ipukit-mnist is not installed next to this Python (pip install -e .)")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--gradient-accumulation" in proc.stdout


def test_bad_flag_value_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        mnist_pipeline.main(["--strategy", "diagonal"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--strategy" in err[0]


def test_limit_without_a_full_batch_is_explained(data_root, capsys):
    code = mnist_pipeline.main(["--data", data_root, "--limit-train", "10"])
    assert code == 1
    err = capsys.readouterr().err
    assert "--limit-train" in err and "4000" in err and "Traceback" not in err


def test_sharded_gpipe_sum_run(data_root, capsys):
    """Every strategy / output mode combination trains: sharded with summed outputs here."""
    code = mnist_pipeline.main(["--data", data_root, "--strategy", "sharded",
                                "--output-mode", "sum", "--schedule", "gpipe",
                                "--offload-optimiser", *QUICK])
    assert code == 0
    assert final_accuracy(capsys.readouterr().out) > 50.0


@pytest.mark.skipif(importlib.util.find_spec("ipukit.viz.profile") is None,
                    reason="ipukit/profile.py (write_profile) is not in this checkout yet")
def test_profile_writes_trace_and_report(data_root, tmp_path, capsys):
    out = tmp_path / "profile"
    code = mnist_pipeline.main(["--data", data_root, "--profile", "--profile-dir", str(out),
                                *QUICK])
    assert code == 0, capsys.readouterr().err
    names = [p.name for p in out.rglob("*") if p.is_file()]
    assert any(n.endswith(".json") for n in names), names
    assert any(n.endswith(".html") for n in names), names


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("IPUKIT_SLOW") != "1",
                    reason="two full MNIST epochs; run with IPUKIT_SLOW=1 pytest -m slow")
def test_two_epochs_with_tutorial_defaults(data_root):
    start = time.perf_counter()
    proc = run_script(["--epochs", "2"], data_root, timeout=3600)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    acc = final_accuracy(proc.stdout)
    print(f"tutorial defaults, 2 epochs: test accuracy {acc:.2f}% in {wall:.0f} s")
    assert 97.5 < acc < 99.9
