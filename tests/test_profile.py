"""Profile files: a Chrome trace and an offline HTML report per call, never overwritten."""
import json
import pathlib
import re

import torch

import ipukit
from ipukit.viz.profile import write_profile
from test_timeline import SleepStack, pipelined


def test_write_profile_of_a_modeled_timeline(tmp_path):
    tl = ipukit.simulate("1f1b", 3, 4)
    paths = write_profile(tl, str(tmp_path / "prof"))
    assert set(paths) == {"trace", "html"}
    trace = json.loads(open(paths["trace"]).read())
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == len(tl.events)
    page = open(paths["html"], encoding="utf-8").read()
    assert len(page) > 1_000_000                                  # plotly.js is inside
    assert "Plotly.newPlot" in page and "plotly.js v" in page.lower()
    assert not re.search(r"<script[^>]+src=[\"']https?://", page)  # nothing from the network
    assert "modeled" in page


def test_profile_dir_writes_every_call_of_every_model(tmp_path):
    out = tmp_path / "profile"
    net = SleepStack(ms=(0.5, 0.5))
    opts = pipelined(2, gradientAccumulation=3).profileDir(str(out))
    train = ipukit.trainingModel(net, opts)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    train(x, y)
    train(x, y)
    other = ipukit.trainingModel(SleepStack(ms=(0.5, 0.5)), opts)     # same folder, same kind
    other(x, y)
    infer = ipukit.inferenceModel(net, pipelined(2, deviceIterations=2).profileDir(str(out)))
    infer(x[:4], y[:4])
    names = sorted(p.name for p in out.iterdir())
    stems = sorted({n.split(".")[0] for n in names})
    assert stems == ["inference-call0000", "training-call0000", "training-call0001",
                     "training1-call0000"]
    for stem in stems:
        trace = json.loads((out / f"{stem}.trace.json").read_text())
        assert trace["otherData"]["ipukit"] == "measured"
        page = (out / f"{stem}.html").read_text(encoding="utf-8")
        assert "Memory per stage" in page and "Utilisation per virtual IPU" in page
        memory = json.loads((out / f"{stem}.memory.json").read_text())
        assert [st["blocks"] for st in memory["stages"]] == [["B0"], ["B1"]]
    calls = {json.loads((out / f"training-call000{k}.trace.json").read_text())["otherData"]["call"]
             for k in (0, 1)}
    assert calls == {0, 1}


def test_a_profile_without_the_viz_extra_keeps_the_trace_and_says_what_is_missing(tmp_path):
    """plotly missing: the trace and memory are written, the HTML names the extra to install."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('plotly',):
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        import torch, ipukit
        from helpers import StackNet, make_data
        opts = ipukit.Options().profileDir({str(tmp_path)!r})
        opts.Training.gradientAccumulation(3)
        net = StackNet(num_blocks=2)
        m = ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        m(*make_data(6))
        print('plotly' in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    html = next(tmp_path.glob("*.html")).read_text()
    assert 'pip install &quot;ipukit[viz]&quot;' in html
    assert list(tmp_path.glob("*.trace.json"))
