"""Every notebook, run in JupyterLab in headless Chromium: what the reader sees is what ran.

For each notebook in notebooks/ (a new notebook is covered automatically):

* every code cell ran and none shows an error;
* every widget rendered: for each widget output, every widget of its tree in the kernel
  has a view on the page that is not an error view (and no "Error displaying widget");
* every figure the kernel holds (cell results, live FigureWidgets and plotly outputs of
  Output widgets) is drawn by
  plotly.js with the same traces and the same numbers, and nothing else is drawn;
* the values the notebook's checks display (its final cell) match specific figures,
  e.g. the explorer's utilisation bars: one per stage, the values the kernel holds.

Then a real interaction: keyboard and ``select_option`` on the explorer's controls, and
the modeled figures redrawn with the values ``ipukit.widgets.logic`` computes here, in
the test process, for the new control values (the browser -> kernel -> browser round trip).

``IPUKIT_DOCS=1`` also regenerates docs/*.png (``-k docs`` runs only that).
Screenshots of each notebook go to test-artifacts/.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from .conftest import DATA, NOTEBOOKS, ROOT, TIMINGS, close_page, open_page

NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
EXPLORER = "02_pipeline_explorer.ipynb"
WALKTHROUGH = "01_pipelining_walkthrough.ipynb"
#: notebooks run by the other two browser-test files, so that the suite's processes
#: (pytest-xdist, a file each) run the browser tests side by side; this file runs the rest
#: (01, 02, the explorer's interactions and any new notebook)
LESSONS = ["03_scripts_and_profiles.ipynb", "04_running_poptorch_code.ipynb",
           "05_lightning_on_ipukit.ipynb"]
SCALING = ["06_scaling_out.ipynb", "07_costs_of_pipelining.ipynb", "08_plan_fit_debug.ipynb"]
HERE = [n for n in NAMES if n not in LESSONS + SCALING]
DOCS = ROOT / "docs"
DOCS_MAX_BYTES = 256 * 1024      # the explorer with its speed-first summary: 216 KB
#: an executed notebook saved from JupyterLab: its outputs (figures as plotly JSON), no widget state
SAVED_MAX_BYTES = 2 * 1024 * 1024

# -- code run in a notebook's kernel after the notebook ran (no cell is added) --------------

# Every figure the kernel holds: cell results (``Out``) and live FigureWidgets, as plain data.
KERNEL_FIGURES = r'''
def _ipukit_figures():
    import json
    import numpy as np
    from plotly.basedatatypes import BaseFigure
    from plotly.basewidget import BaseFigureWidget
    from ipywidgets.widgets.widget import _instances

    def column(values):
        if values is None:
            return None
        if isinstance(values, dict) and "bdata" in values:      # plotly's typed-array JSON
            import base64
            values = np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
        def plain(v):
            if isinstance(v, (bool, np.bool_)) or v is None:
                return v
            if isinstance(v, (int, float, np.number)):
                return None if v != v else float(v)          # NaN travels as null
            return str(v)

        return [plain(v) for v in np.asarray(values, dtype=object).ravel().tolist()]

    def describe(fig, where):
        traces = []
        for t in fig.data:
            d = t.to_plotly_json()
            traces.append({"type": d.get("type", "scatter"), "name": d.get("name"),
                           **{k: column(d.get(k)) for k in ("x", "y", "base")}})
        return {"where": where, "title": fig.layout.title.text or "", "traces": traces}

    out = globals().get("Out", {})
    figures = [describe(v, f"Out[{n}]") for n, v in sorted(out.items())
               if isinstance(v, BaseFigure) and not isinstance(v, BaseFigureWidget)]
    figures += [describe(w, f"FigureWidget {w.model_id}") for w in list(_instances.values())
                if isinstance(w, BaseFigureWidget)]
    # figures an Output widget holds as plotly outputs (the explorer's boxes)
    import plotly.graph_objects as go
    from ipywidgets import Output
    figures += [describe(go.Figure(o["data"]["application/vnd.plotly.v1+json"]),
                         f"Output {w.model_id}")
                for w in list(_instances.values()) if isinstance(w, Output)
                for o in w.outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    print(json.dumps(figures))

_ipukit_figures()
del _ipukit_figures
'''

# The widget tree below each displayed root (model id -> model name), from the kernel.
KERNEL_WIDGET_TREES = r'''
def _ipukit_widget_trees(roots):
    import json
    from ipywidgets.widgets.widget import _instances

    def walk(widget, seen):
        if widget.model_id not in seen:
            seen[widget.model_id] = widget._model_name
            for child in getattr(widget, "children", None) or ():
                walk(child, seen)
        return seen

    print(json.dumps({r: walk(_instances[r], {}) if r in _instances else None for r in roots}))

_ipukit_widget_trees(%s)
del _ipukit_widget_trees
'''

WIDGET_ROOTS_JS = """
const roots = [];
for (const cell of panel.content.widgets) {
  if (cell.model.type !== 'code') continue;
  for (let j = 0; j < cell.model.outputs.length; j++) {
    const spec = (cell.model.outputs.get(j).data || {})['application/vnd.jupyter.widget-view+json'];
    if (spec) roots.push(spec.model_id);
  }
}
return roots;
"""


# -- running notebooks, once per module ----------------------------------------------------

class Notebooks:
    """Runs each notebook once (fresh kernel) and keeps its tab open for later tests."""

    def __init__(self, lab, browser):
        self.lab, self.browser, self.pages = lab, browser, {}

    def run(self, name: str):
        if name in self.pages:
            return self.pages[name]
        if not os.path.isdir(os.path.join(DATA, "MNIST", "raw")):
            pytest.skip(f"real MNIST not found under {DATA}/MNIST/raw (set IPUKIT_DATA)")
        t0 = time.time()
        nb = open_page(self.lab, self.browser, name)
        self.pages[name] = nb
        t1 = time.time()
        nb.hide_side_panels()
        try:
            nb.run_all()
        except Exception:
            nb.screenshot(f"{Path(name).stem}-run-failed.png")
            raise
        if name == EXPLORER:
            # every figure again, once the page has settled
            nb.page.wait_for_timeout(2000)
            nb.kernel_execute("explorer.redraw()")
        TIMINGS[name] = {"open": t1 - t0, "run": time.time() - t1}
        return nb

    def release(self, name: str) -> None:
        """Close ``name``'s tab and shut its kernel down (a later ``run`` opens it afresh)."""
        nb = self.pages.pop(name, None)
        if nb is not None:
            close_page(self.lab, nb)

    def close(self):
        for nb in self.pages.values():
            close_page(self.lab, nb)
        self.pages.clear()


#: notebooks whose tab later tests use again; every other one is closed after its test, so
#: no idle kernel holds memory or a core while the rest run
KEPT = {EXPLORER} | ({WALKTHROUGH} if os.environ.get("IPUKIT_DOCS") == "1" else set())


@pytest.fixture(scope="module")
def notebooks(lab, browser):
    runner = Notebooks(lab, browser)
    yield runner
    runner.close()


# -- comparing drawn figures with the kernel's ----------------------------------------------

def same_value(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if a is None or b is None:    # NaN travels as null one way and NaN the other
        other = b if a is None else a
        return other is None or (isinstance(other, float) and math.isnan(other))
    return str(a) == str(b)


def trace_difference(kernel: dict, drawn: dict):
    """None if the drawn trace holds the kernel's data, else what differs."""
    for key in ("type", "name"):
        if kernel.get(key) != drawn.get(key):
            return f"{key}: kernel {kernel.get(key)!r}, drawn {drawn.get(key)!r}"
    for key in ("x", "y", "base"):
        k, d = kernel.get(key), drawn.get(key)
        if k is None and d is None:
            continue
        if k is None or d is None or len(k) != len(d):
            return (f"{key}: kernel has {None if k is None else len(k)} values, "
                    f"drawn {None if d is None else len(d)}")
        for i, (a, b) in enumerate(zip(k, d)):
            if not same_value(a, b):
                return f"{key}[{i}]: kernel {a!r}, drawn {b!r}"
    return None


def figure_difference(kernel: dict, drawn: dict):
    if kernel["title"] != drawn["title"]:
        return f"title: kernel {kernel['title']!r}, drawn {drawn['title']!r}"
    if len(kernel["traces"]) != len(drawn["traces"]):
        return f"kernel has {len(kernel['traces'])} traces, drawn {len(drawn['traces'])}"
    for i, (k, d) in enumerate(zip(kernel["traces"], drawn["traces"])):
        diff = trace_difference(k, d)
        if diff:
            return f"trace {i} ({k.get('name')}): {diff}"
    return None


def head(title: str) -> str:
    """A figure title without its subtitle (which carries numbers that change)."""
    return (title or "").split("<br>")[0]


def plot_titled(plots: list, title: str) -> dict:
    found = [p for p in plots if head(p["title"]) == head(title)]
    assert found, f"no plot titled {head(title)!r}; drawn: {[head(p['title']) for p in plots]}"
    return found[0]


def plot_starting(plots: list, prefix: str) -> dict:
    found = [p for p in plots if p["title"].startswith(prefix)]
    assert found, f"no plot titled {prefix!r}...; drawn: {[head(p['title']) for p in plots]}"
    return found[0]


def approx_list(a, b, rel=1e-9) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-9)
                                    for x, y in zip(a, b))


def check_figures(nb) -> int:
    """Every figure the kernel holds is drawn with its data, and nothing else is drawn."""
    kernel = json.loads(nb.kernel_execute(KERNEL_FIGURES))

    def compare():
        drawn = nb.plots()
        unmatched = list(drawn)
        problems = []
        for fig in kernel:
            match = next((d for d in unmatched if figure_difference(fig, d) is None), None)
            if match is not None:
                unmatched.remove(match)
                continue
            alike = [d for d in unmatched if head(d["title"]) == head(fig["title"])]
            why = figure_difference(fig, alike[0]) if alike else "no plot with this title is drawn"
            problems.append(f"{fig['where']} {head(fig['title'])!r}: {why}")
        problems += [f"drawn but not held by the kernel: {head(d['title'])!r}" for d in unmatched]
        assert not problems, (f"{len(kernel)} figures in the kernel, {len(drawn)} drawn:\n  "
                              + "\n  ".join(problems))
        for d in drawn:
            assert d["width"] > 0 and d["height"] > 0, f"{head(d['title'])!r} has no size"
        return len(drawn)

    return nb.wait_for(compare)


def check_widgets(nb) -> int:
    """Every widget of every displayed widget tree has a working view on the page."""
    roots = nb.js(WIDGET_ROOTS_JS)
    trees = json.loads(nb.kernel_execute(KERNEL_WIDGET_TREES % json.dumps(roots)))
    expected = {root: list(tree) for root, tree in trees.items() if tree is not None}

    def compare():
        report = nb.widget_views(expected)
        problems = []
        for entry in report:
            tree = trees.get(entry["root"])
            if tree is None:
                continue            # closed in the kernel: nothing to show
            if entry["error"]:
                problems.append(f"cell {entry['cell']}: {entry['error']}")
                continue
            for model_id, name in tree.items():
                got = entry["models"].get(model_id) or {}
                if got.get("views", 0) < 1 or got.get("name") != name:
                    problems.append(f"cell {entry['cell']}: {name} {model_id[:8]}: "
                                    f"{got.get('views', 0)} views, {got.get('error_views', 0)} "
                                    f"error views, front-end model {got.get('name')!r}"
                                    + (f" ({got['error']})" if got.get("error") else ""))
        assert not problems, (f"{len(problems)} of {sum(len(t) for t in expected.values())} "
                              "widgets not rendered:\n  " + "\n  ".join(problems[:20]))
        return sum(len(t) for t in expected.values())

    return nb.wait_for(compare)


# -- what each notebook's IPUKIT_CHECK lines promise ---------------------------------------

def explorer_model(shown: dict):
    """The explorer's Config and CostTable (calibrated in the kernel), rebuilt here from what
    the kernel printed."""
    from ipukit.widgets.logic import Config, CostTable

    config = Config(**{**shown["config"], "blocks": tuple(shown["config"]["blocks"])})
    return config, CostTable(**shown["costs"])


def expected_modeled(shown: dict, **changes):
    """The modeled view ``ipukit.widgets.logic`` gives for the kernel's settings + ``changes``."""
    from ipukit.widgets import logic

    config, costs = explorer_model(shown)
    return logic.modeled_view(config.with_(**changes), costs, shown["samples"],
                              parameters=shown["parameters"])


def bars(plot: dict) -> list:
    traces = [t for t in plot["traces"] if t["type"] == "bar"]
    assert len(traces) == 1, f"{head(plot['title'])!r}: {len(traces)} bar traces"
    return traces[0]


def slider_readout(nb, description: str) -> str:
    slider = nb.node.locator(".widget-slider", has=nb.page.get_by_text(description, exact=True))
    return slider.locator(".widget-readout").text_content().strip()


def check_explorer(nb, plots):
    from ipukit.widgets.logic import bar_values

    shown = nb.marker("explorer")
    in_widgets = [p for p in plots if p["in_widget"]]
    assert len(in_widgets) == shown["figures"] == 7
    # the checks end with one call at the settings the controls show (issue 26: no panel
    # shows a call the controls do not describe)
    for name, values in (("modeled utilisation", shown["modeled"]),
                         ("measured utilisation", shown["measured"])):
        drawn = bars(plot_titled(plots, shown["titles"][name]))
        assert len(drawn["y"]) == shown["stages"], f"{name}: one bar per stage"
        assert drawn["x"] == [f"IPU {i}" for i in range(shown["stages"])]
        assert approx_list(drawn["y"], values), f"{name}: drawn {drawn['y']}, kernel {values}"
    # issue 26: the modeled headline is the same before and after a Run with nothing changed
    assert shown["modeled_after_run"] == shown["modeled_before_run"]
    # the kernel's modeled numbers are what the logic computes here from its settings
    assert approx_list(bar_values(expected_modeled(shown).utilisation), shown["modeled"])
    # the controls show the kernel's values
    config = shown["config"]
    for description, key in (("device iterations", "device_iterations"),
                             ("gradient accumulation", "gradient_accumulation"),
                             ("micro-batch size", "micro_batch_size")):
        assert slider_readout(nb, description) == str(config[key]), description


def check_walkthrough(nb, plots):
    shown = nb.marker("walkthrough")
    busy = bars(plot_starting(plots, "Busy share of each virtual IPU"))
    assert busy["x"] == ["IPU 0", "IPU 1", "IPU 2", "IPU 3"]
    assert approx_list(busy["y"], shown["utilisation"]), (busy["y"], shown["utilisation"])
    loss = [t for t in plot_starting(plots, "Training")["traces"] if t["name"] == "loss"]
    assert loss and approx_list(loss[0]["y"], shown["loss"])
    # tqdm's progress bars (widgets): one per epoch and one for testing, each complete
    texts = nb.node.locator(".widget-hprogress").locator("xpath=..").all_text_contents()
    calls, tests = shown["calls_per_epoch"], shown["test_calls"]
    assert len(texts) == shown["epochs"] + 1, texts
    for text in texts[:-1]:
        assert "100%" in text and f"{calls}/{calls}" in text, text
    assert "100%" in texts[-1] and f"{tests}/{tests}" in texts[-1], texts[-1]


def check_profiles(nb, plots):
    shown = nb.marker("profiles")
    three = plot_starting(plots, "Three training calls")
    assert sum(len(t["x"]) for t in three["traces"]) == shown["events"]
    memory = plot_starting(plots, "Memory per stage")
    assert all(len(t["x"]) == shown["stages"] for t in memory["traces"])


def check_porting(nb, plots):
    shown = nb.marker("porting")
    bars = plot_starting(plots, "Gradient magnitudes")["traces"][0]
    assert len(bars["y"]) == shown["bars"] and round(sum(bars["y"])) == shown["gradients"]


def device_rows(plot: dict) -> dict:
    """Row name -> bars drawn on it, for every row of a Gantt chart but the host's."""
    rows = Counter()
    for trace in plot["traces"]:
        for row in trace["y"] or ():
            if row != "host":
                rows[row] += 1
    return dict(rows)


def check_scaling(nb, plots):
    shown = nb.marker("scaling")
    rows = device_rows(plot_starting(plots, "2 stages × 2 replicas on threads"))
    assert sorted(rows) == ["IPU 0", "IPU 0 · replica 1", "IPU 1", "IPU 1 · replica 1"], rows
    assert len(rows) == shown["replica_tracks"] and sum(rows.values()) == shown["passes"]


def check_costs(nb, plots):
    shown = nb.marker("costs")
    for kind, title in (("Interleaved1F1B", "Interleaved 1F1B on 2 devices"),
                        ("ZBV", "ZBV on 2 devices")):
        figure = plot_starting(plots, title)
        rows = device_rows(figure)
        assert sorted(rows) == ["IPU 0", "IPU 1"], (kind, rows)   # one row per device
        assert sum(rows.values()) == shown["passes"][kind], (kind, rows)
        assert "IPU 0: stages" in figure["title"] and "IPU 1: stages" in figure["title"]
    link = plot_starting(plots, "Time per call against the link's bandwidth")
    assert len(link["traces"][0]["x"]) == shown["link_points"]
    readout = float(slider_readout(nb, "link MB/s"))
    assert math.isclose(readout, shown["bandwidth_mb"], rel_tol=0.01), (readout, shown)


def check_plan_fit_debug(nb, plots):
    shown = nb.marker("plan")
    bars = plot_starting(plots, "Measured peak per virtual IPU")
    assert [t["name"] for t in bars["traces"]] == list(shown["convnet_bars"]), bars["traces"]
    for trace in bars["traces"]:
        assert trace["x"] == shown["schedules"], trace["x"]
        assert approx_list(trace["y"], shown["convnet_bars"][trace["name"]], rel=1e-5), trace
    memory = plot_starting(plots, "1F1B, measured memory")
    lines = [t for t in memory["traces"] if (t["name"] or "").endswith(" memory")]
    assert len(lines) == shown["memory_tracks"] == 2, [t["name"] for t in memory["traces"]]


SPECIFIC = {EXPLORER: check_explorer, WALKTHROUGH: check_walkthrough,
            "03_scripts_and_profiles.ipynb": check_profiles,
            "04_running_poptorch_code.ipynb": check_porting,
            "06_scaling_out.ipynb": check_scaling,
            "07_costs_of_pipelining.ipynb": check_costs,
            "08_plan_fit_debug.ipynb": check_plan_fit_debug}


# -- the tests -------------------------------------------------------------------------------

def test_every_notebook_is_covered():
    assert {EXPLORER, WALKTHROUGH} <= set(HERE) and set(LESSONS + SCALING) <= set(NAMES), NAMES


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", HERE)
def test_notebook_runs_and_renders_in_jupyterlab(notebooks, name):
    run_and_check(notebooks, name)


def run_and_check(notebooks, name: str) -> None:
    """Run notebook ``name`` in JupyterLab and check what it shows (see the module's docstring)."""
    nb = notebooks.run(name)
    t0 = time.time()
    failures, found = [], {}

    def check(what, fn, *args):
        """Run every check and report all that fail, not only the first."""
        try:
            found[what] = fn(*args)
        except AssertionError as e:
            failures.append(f"[{what}] {e}")

    def no_errors():
        errors = nb.errors()
        assert not errors, f"{len(errors)} cells show an error:\n" + "\n---\n".join(errors)

    def all_cells_ran():
        counts = nb.execution_counts()
        assert None not in counts, f"code cells not run: {[i for i, c in enumerate(counts) if c is None]}"
        return len(counts)

    def no_widget_errors():
        errors = nb.widget_errors()
        assert not errors, f"{len(errors)} widget errors: {errors}"

    def saved_copy_is_small():
        """Saved as a learner saves it (JupyterLab's own save, its default settings: widget
        state is not stored), the executed notebook stays small."""
        nb.js("await panel.context.save();")
        size = (Path(notebooks.lab["root"]) / name).stat().st_size
        assert size <= SAVED_MAX_BYTES, f"the saved copy is {size / 1e6:.1f} MB"
        return size

    try:
        check("cell errors", no_errors)
        check("cells run", all_cells_ran)
        check("widget errors", no_widget_errors)
        check("widget views", check_widgets, nb)
        check("figures", check_figures, nb)
        if name in SPECIFIC:
            check("checks displayed", lambda: SPECIFIC[name](nb, nb.plots()))
        check("saved copy", saved_copy_is_small)
        assert not failures, f"{name}: {len(failures)} checks failed\n" + "\n".join(failures)
        print(f"{name}: {found['cells run']} code cells, {found['widget views']} widgets, "
              f"{found['figures']} figures checked, saved copy {found['saved copy']} bytes")
    finally:
        # the first rich output in view, for the artefact
        rich = nb.node.locator(".js-plotly-plot, .jupyter-widgets")
        if rich.count():
            rich.first.scroll_into_view_if_needed()
            nb.page.wait_for_timeout(1500)      # cells scrolled into view are painted lazily
        nb.screenshot(f"{Path(name).stem}.png")
        TIMINGS.setdefault(name, {"open": 0.0, "run": 0.0})["checks"] = time.time() - t0
        if name not in KEPT:
            notebooks.release(name)


@pytest.mark.timeout(1200)
@pytest.mark.skipif(os.environ.get("IPUKIT_DOCS") != "1", reason="IPUKIT_DOCS=1 regenerates docs/")
def test_docs_screenshots(notebooks):
    """docs/explorer.png, docs/walkthrough-timeline.png and docs/schedule-grids.png, cropped."""
    DOCS.mkdir(exist_ok=True)
    written = []
    nb = notebooks.run(WALKTHROUGH)
    plots = nb.plots()
    index = plots.index(plot_starting(plots, "Last training call"))
    target = nb.node.locator(".js-plotly-plot").nth(index)
    target.scroll_into_view_if_needed()
    time.sleep(1)
    written.append(nb.screenshot("walkthrough-timeline.png", target))
    index = plots.index(plot_starting(plots, "Idealised schedules: 4 stages, 8 micro-batches"))
    target = nb.node.locator(".js-plotly-plot").nth(index)
    target.scroll_into_view_if_needed()
    time.sleep(1)
    written.append(nb.screenshot("schedule-grids.png", target))
    nb = notebooks.run(EXPLORER)
    check_figures(nb)
    target = nb.node.locator(".jp-OutputArea-output").filter(
        has=nb.page.locator(".js-plotly-plot")).first
    # the notebook scrolls inside the page: make the page tall enough to show the whole
    # dashboard at once (same width, so nothing is laid out again)
    size = nb.page.viewport_size
    nb.page.set_viewport_size({"width": size["width"],
                               "height": max(size["height"], int(target.bounding_box()["height"]) + 300)})
    try:
        target.scroll_into_view_if_needed()
        time.sleep(1)
        written.append(nb.screenshot("explorer.png", target))
    finally:
        nb.page.set_viewport_size(size)
    for path in written:
        dest = DOCS / path.name
        dest.write_bytes(path.read_bytes())
        assert dest.stat().st_size < DOCS_MAX_BYTES, f"{dest} is {dest.stat().st_size} bytes"


@pytest.mark.timeout(1200)
def test_explorer_figures_fit_their_boxes(notebooks):
    """Each of the explorer's figures is laid out at the width of the box that holds it."""
    nb = notebooks.run(EXPLORER)
    figures = [p for p in nb.plots() if p["in_widget"]]
    assert len(figures) == 7, f"{len(figures)} of the explorer's 7 figures drawn"
    problems = [f"{head(p['title'])!r}: drawn {p['drawn_width']} px wide in a {p['box_width']} px box"
                for p in figures if not
                (0.9 * p["box_width"] <= p["drawn_width"] <= p["box_width"] + 1)]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(1200)
def test_explorer_controls_round_trip(notebooks):
    """Move the explorer's controls with the keyboard and a <select>: the modeled figures follow.

    The expected bars are computed here with ipukit.widgets.logic from the settings and costs
    the kernel printed, so a pass means: browser event -> kernel callback -> new modeled view
    -> new plotly output -> plotly.js draws it, with the numbers the model gives.
    """
    from ipukit.viz import plots as ipuplots
    from ipukit.widgets.logic import bar_values

    nb = notebooks.run(EXPLORER)
    shown = nb.marker("explorer")
    title = shown["titles"]["modeled utilisation"]
    old = shown["config"]["gradient_accumulation"]

    def expect(view, stages):
        want = bar_values(view.utilisation)

        def check():
            plots = nb.plots()
            got = bars(plot_titled(plots, title))
            assert len(got["y"]) == stages, f"{len(got['y'])} bars drawn, {stages} stages"
            assert approx_list(got["y"], want), f"drawn {got['y']}, model {want}"
            # the modeled timeline: as many bars of each kind as the model's events
            timeline = plot_starting(plots, "Modeled call")
            # one bar per pass and host span, and one per optimiser step (on the host row)
            events = Counter(ipuplots.LABELS.get(e.kind, e.kind) for e in view.drawn.events
                             if e.kind != "step")
            events.update(ipuplots.LABELS["step"] for _ in view.drawn.host_steps())
            assert {t["name"]: len(t["x"]) for t in timeline["traces"]} == dict(events)
            return got["y"]

        return nb.wait_for(check)

    before = expect(expected_modeled(shown), shown["stages"])
    assert approx_list(before, shown["modeled"])

    # 1. keyboard: End on the gradient-accumulation slider's handle -> its maximum
    slider = nb.node.locator(".widget-slider",
                             has=nb.page.get_by_text("gradient accumulation", exact=True))
    handle = slider.locator(".noUi-handle")
    handle.scroll_into_view_if_needed()
    handle.focus()
    nb.page.keyboard.press("End")
    nb.wait_for(lambda: int(slider.locator(".widget-readout").text_content()) > old)
    top = int(slider.locator(".widget-readout").text_content())
    assert top == 64
    after = expect(expected_modeled(shown, gradient_accumulation=top), shown["stages"])
    # the law (tests/test_widgets.py): more micro-batches per step is faster, with a smaller
    # fill/drain bubble; the busy work per sample is fixed, so the IPUs are busier too
    old_view = expected_modeled(shown)
    new_view = expected_modeled(shown, gradient_accumulation=top)
    assert new_view.samples_per_second > old_view.samples_per_second
    assert new_view.bubble < old_view.bubble
    assert sum(after) > sum(before), "more micro-batches per step: busier IPUs"
    # the kernel agrees with what is drawn
    state = json.loads(nb.kernel_execute(
        "import json; from ipukit.widgets.logic import bar_values as _bv\n"
        "print(json.dumps([explorer.config.gradient_accumulation,"
        " _bv(explorer.modeled_utilisation)]))"))
    assert state[0] == top and approx_list(state[1], after)
    nb.node.locator(".js-plotly-plot").nth(1).scroll_into_view_if_needed()
    nb.screenshot("02_pipeline_explorer-ga64.png")

    # 2. arrow keys: two steps down
    handle.focus()
    nb.page.keyboard.press("ArrowLeft")
    nb.page.keyboard.press("ArrowLeft")
    nb.wait_for(lambda: int(slider.locator(".widget-readout").text_content()) == top - 2)
    expect(expected_modeled(shown, gradient_accumulation=top - 2), shown["stages"])

    # 3. the stage-split <select>: two stages -> two bars, the model's values
    split = "B1 B2 | B3 B4"
    select = nb.node.locator(".widget-dropdown",
                             has=nb.page.get_by_text("stage split", exact=True)).locator("select")
    select.select_option(split)
    expect(expected_modeled(shown, gradient_accumulation=top - 2, split=split), 2)

    # 4. Home: gradient accumulation 1, which PopTorch rejects for a 2-stage pipeline
    handle.focus()
    nb.page.keyboard.press("Home")
    nb.wait_for(lambda: int(slider.locator(".widget-readout").text_content()) == 1)
    expect(expected_modeled(shown, gradient_accumulation=1, split=split), 2)
    message = nb.node.locator(".widget-html", has_text="PopTorch would reject this")
    nb.wait_for(lambda: message.count() == 1 and "gradientAccumulation" in message.text_content())
    nb.screenshot("02_pipeline_explorer-rejected.png")


KERNEL_EXPLORER_STATE = r'''
import dataclasses as _dc, json as _json
explorer.wait_for_verdict()
print(_json.dumps({"config": _dc.asdict(explorer.config), "costs": _dc.asdict(explorer.costs),
                   "samples": explorer.samples_per_epoch,
                   "parameters": explorer.probe_result.parameters}))
del _dc, _json
'''


def kernel_explorer_state(nb) -> dict:
    """The explorer's current settings and costs, from the kernel."""
    return json.loads(nb.kernel_execute(KERNEL_EXPLORER_STATE))


@pytest.mark.timeout(1200)
def test_explorer_model_selector_and_layers_per_ipu(notebooks):
    """Choose the ViT in the model <select>, type layers_per_ipu into its box: the modeled
    bars are the ViT's, computed here with ipukit.widgets.logic (the placement read from the
    ViT's own parallelize(IPUConfig)); counts that do not make 8 layers show IPUConfig's error."""
    from ipukit.widgets import logic

    nb = notebooks.run(EXPLORER)
    from ipukit.examples import mnist, vit

    # a legal window for every split below, set from code; the rest as the kernel has it
    nb.kernel_execute("explorer.set(model='convnet', schedule='1F1B', gradient_accumulation=16, "
                      "layers_per_ipu='2, 2, 2, 2')")
    state = kernel_explorer_state(nb)
    _, convnet_costs = explorer_model(state)
    keep = {k: v for k, v in state["config"].items()
            if k not in ("model", "blocks", "split", "layers_per_ipu", "ipus", "model_ipus")}
    # the ViT's table, calibrated in the kernel at the same micro-batch size
    vit_costs = logic.CostTable(**json.loads(nb.kernel_execute(
        "import dataclasses as _dc, json as _json; from ipukit.widgets import logic as _logic\n"
        "print(_json.dumps(_dc.asdict(_logic.calibrated_costs(explorer.models['ViT'], "
        "explorer.config.micro_batch_size))))")))
    title = "Utilisation per virtual IPU — modeled"
    modeled_box = nb.node.locator(".widget-vbox", has_text="Modeled — updates").first

    def expect(layers, stages):
        config = logic.example_config(vit.explorer_model(), layers_per_ipu=layers, **keep)
        view = logic.modeled_view(config, vit_costs, state["samples"])
        want = logic.bar_values(view.utilisation)

        def check():
            got = bars(plot_titled(nb.plots(), title))
            assert len(got["y"]) == stages, f"{len(got['y'])} bars drawn, {stages} stages"
            assert approx_list(got["y"], want), f"drawn {got['y']}, model {want}"
            return got["y"]

        return nb.wait_for(check)

    select = nb.node.locator(".widget-dropdown",
                             has=nb.page.get_by_text("model", exact=True)).locator("select")
    select.select_option("ViT")
    level = expect([2, 2, 2, 2], 4)      # the bars are the model's (the costs: this machine's)
    # a Combobox: a text box with suggestions; its label's parent is the widget
    field = nb.node.get_by_text("layers per IPU", exact=True).locator("xpath=..").locator("input")
    assert field.is_visible()
    assert not nb.node.locator(".widget-dropdown", has=nb.page.get_by_text(
        "stage split", exact=True)).is_visible()

    def type_layers(text):
        field.fill(text)
        field.press("Enter")

    type_layers("3, 3, 1, 1")
    lopsided = expect([3, 3, 1, 1], 4)
    assert max(lopsided) - min(lopsided) > max(level) - min(level)
    type_layers("2, 2, 2")
    message = nb.node.locator(".widget-html", has_text="PopTorch would reject this")
    nb.wait_for(lambda: message.count() == 1 and "places 6 layers" in message.text_content())
    expect([3, 3, 1, 1], 4)                       # the last modeled view stays
    type_layers("-1, -1")
    expect([-1, -1], 2)
    nb.wait_for(lambda: message.count() == 0)
    modeled_box.scroll_into_view_if_needed()
    nb.screenshot("02_pipeline_explorer-vit.png")
    # and back: the convnet's split control and its four bars
    select.select_option("convnet")
    nb.wait_for(lambda: not field.is_visible())
    convnet = logic.example_config(mnist.explorer_model(), split=state["config"]["split"], **keep)
    view = logic.modeled_view(convnet, convnet_costs, state["samples"])
    nb.wait_for(lambda: approx_list(bars(plot_titled(nb.plots(), title))["y"],
                                    logic.bar_values(view.utilisation)))


@pytest.mark.timeout(1200)
def test_explorer_schedule_selector_and_comparison(notebooks):
    """Choose schedules in the schedule <select>: the comparison chart draws, for every
    schedule, the time per step, bubble and peak activations that ipukit.widgets.comparison
    computes here (ipukit.simulate on the kernel's stages, batching and costs), and the modeled
    timeline of the selected one draws its passes (I and W for the zero-bubble schedules) on
    the IPUs its placement uses."""
    from ipukit.viz import plots as ipuplots
    from ipukit.schedules.generators import placement
    from ipukit.widgets import comparison, logic

    nb = notebooks.run(EXPLORER)
    nb.kernel_execute("explorer.set(model='convnet', split='B1 | B2 | B3 | B4', schedule='1F1B', "
                      "sharded=False, gradient_accumulation=16)")
    state = kernel_explorer_state(nb)
    config, costs = explorer_model(state)
    select = nb.node.locator(".widget-dropdown",
                             has=nb.page.get_by_text("schedule", exact=True)).locator("select")
    chart = "Every schedule on these stages — modeled"

    for name in ("ZBV", "ZBH1", "Interleaved1F1B", "1F1B"):
        select.select_option(name)
        chosen = logic.placed(config.with_(schedule=name))
        rows = comparison.schedule_rows(chosen, costs, state["samples"], state["parameters"])
        want = [[1e3 * r.time_per_step for r in rows], [100 * r.bubble for r in rows],
                [r.peak_activations for r in rows]]
        ipus = {f"IPU {i}" for i in chosen.stage_ipus}
        zero_bubble = chosen.schedule_kind in ("zb-h1", "zbv", "dualpipev")

        def check():
            plots = nb.plots()
            drawn = plot_starting(plots, chart)
            assert [t["type"] for t in drawn["traces"]] == ["bar"] * 3
            for trace, values in zip(drawn["traces"], want):
                assert approx_list(trace["y"], values), f"{trace['name']}: drawn {trace['y']}, model {values}"
            assert drawn["traces"][0]["x"][list(logic.SCHEDULES).index("ZBV")] == "ZBV<br>2 IPUs"
            timeline = plot_starting(plots, "Modeled call")
            names = {t["name"] for t in timeline["traces"]}
            labels = {ipuplots.LABELS["input-grad"], ipuplots.LABELS["weight-grad"]}
            assert (labels <= names) == zero_bubble, f"{name}: {names}"
            rows_drawn = {y for t in timeline["traces"] for y in t["y"]} - {"host"}
            assert rows_drawn == ipus, f"{name}: rows {rows_drawn}, placement {ipus}"
            return True

        nb.wait_for(check)
        if name == "ZBV":
            assert chosen.stage_ipus == tuple(placement("zbv", 4))
            nb.node.locator(".js-plotly-plot").first.scroll_into_view_if_needed()
            nb.screenshot("02_pipeline_explorer-zbv.png")


@pytest.mark.timeout(1200)
def test_explorer_suggest_applies_a_plan(notebooks):
    """Type a memory budget per IPU and press Suggest: ipukit.plan's table appears under the
    controls, and the sliders and the schedule <select> show the plan the kernel holds."""
    nb = notebooks.run(EXPLORER)
    tutorial = ("explorer.set(model='convnet', split='B1 | B2 | B3 | B4', schedule='1F1B', "
                "sharded=False, gradient_accumulation=10, device_iterations=10, "
                "micro_batch_size=40)")
    nb.kernel_execute(tutorial)
    budget = nb.node.locator(".widget-text", has=nb.page.get_by_text(
        "memory budget per IPU (MiB)", exact=True)).locator("input")
    budget.scroll_into_view_if_needed()
    budget.fill("100")
    nb.node.locator("button", has_text="Suggest").click()
    table = nb.node.locator(".widget-html", has_text="Suggested and applied")
    nb.wait_for(lambda: table.count() == 1 and "| rank | schedule |" in table.text_content())
    plan = json.loads(nb.kernel_execute(
        "import json as _j; print(_j.dumps(explorer.suggested.to_dict())); del _j"))
    from ipukit.schedules.registry import title_of

    def readout(label):
        slider = nb.node.locator(".widget-slider", has=nb.page.get_by_text(label, exact=True))
        return int(slider.locator(".widget-readout").text_content())

    select = nb.node.locator(".widget-dropdown",
                             has=nb.page.get_by_text("schedule", exact=True)).locator("select")
    nb.wait_for(lambda: (readout("micro-batch size"), readout("gradient accumulation"),
                         select.input_value()) == (plan["micro_batch"],
                                                   plan["gradient_accumulation"],
                                                   title_of(plan["schedule"])))
    assert plan["micro_batch"] * plan["gradient_accumulation"] == 400
    assert max(plan["memory_per_ipu"]) <= 100 * 2 ** 20
    nb.screenshot("02_pipeline_explorer-suggest.png")
    nb.kernel_execute(tutorial + "; explorer.clear_suggestion()")
