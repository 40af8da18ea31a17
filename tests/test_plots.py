"""PopVision-style figures: the right bars, labels and colours, and they work as widgets."""

import plotly.graph_objects as go
import pytest
import torch

import ipukit
from ipukit import Timeline
from ipukit.viz import plots
from ipukit.viz.memory import MemoryReport


def drawn_bars(tl):
    """Bars a Gantt chart of ``tl`` holds: every event, with the steps folded to one per step."""
    return len([e for e in tl.events if e.kind != "step"]) + len(tl.host_steps())


def by_name(fig):
    return {trace.name: trace for trace in fig.data}


def test_gantt_has_one_bar_per_event_coloured_by_kind():
    N, M = 3, 5
    tl = ipukit.simulate("gpipe", N, M, forward_cost=1e-3, backward_cost=2e-3, step_cost=5e-4,
                         host_overhead=1e-3)
    fig = plots.timeline_figure(tl)
    traces = by_name(fig)
    assert len(traces["forward"].x) == N * M
    assert len(traces["backward"].x) == N * M
    # the optimiser step runs once, on the host: one bar on the host row, not one per IPU
    assert len(traces[plots.LABELS["step"]].x) == 1
    assert set(traces[plots.LABELS["step"]].y) == {"host"}
    assert len(traces["host"].x) == 1
    assert traces["forward"].marker.color == plots.COLOURS["forward"]
    assert traces["backward"].marker.color == plots.COLOURS["backward"]
    assert all(t.orientation == "h" for t in fig.data)
    assert fig.layout.barmode == "overlay"
    # micro-batch numbers are written on the bars; steps and host spans carry no number
    assert sorted(traces["forward"].text, key=int) == sorted(
        [str(m) for m in range(M)] * N, key=int)
    assert set(traces[plots.LABELS["step"]].text) == {""}
    # bars start at the event's start and are as long as the event, in ms
    forwards = [e for e in tl.events if e.kind == "forward"]
    i = next(k for k, e in enumerate(forwards) if (e.stage, e.micro_batch) == (2, 4))
    assert traces["forward"].base[i] == pytest.approx(forwards[i].start * 1e3)
    assert traces["forward"].x[i] == pytest.approx(forwards[i].duration * 1e3)
    assert traces["forward"].y[i] == "IPU 2" and traces["forward"].text[i] == "4"


def test_rows_are_virtual_ipus_then_host_and_the_title_says_modeled_or_measured():
    tl = ipukit.simulate("1f1b", 2, 4, replicas=2, host_overhead=0.1)
    fig = plots.timeline_figure(tl, title="My run")
    assert list(fig.layout.yaxis.categoryarray) == [
        "IPU 0", "IPU 0 · replica 1", "IPU 1", "IPU 1 · replica 1", "host"]
    assert fig.layout.yaxis.autorange == "reversed"         # IPU 0 on top
    assert "My run" in fig.layout.title.text and "modeled" in fig.layout.title.text
    measured = Timeline(tl.events, modeled=False, meta=tl.meta)
    assert "measured" in plots.timeline_figure(measured).layout.title.text
    assert "modeled" not in plots.timeline_figure(measured).layout.title.text


def test_idle_gaps_stay_empty():
    """Bubbles are the space between bars: no bar covers an idle stretch of an IPU."""
    tl = ipukit.simulate("gpipe", 4, 4)
    fig = plots.timeline_figure(tl)
    spans = sorted((b, b + w) for t in fig.data for b, w, y in zip(t.base, t.x, t.y)
                   if y == "IPU 3")
    covered = sum(b - a for a, b in spans)
    assert covered == pytest.approx(tl.busy_time()[(0, 3)] * 1e3)
    assert covered < tl.wall_time * 1e3 * 0.75


def test_micro_batch_labels_can_be_left_off():
    fig = plots.timeline_figure(ipukit.simulate("1f1b", 2, 3), show_micro_batches=False)
    assert all(t.text is None for t in fig.data)


def test_utilisation_figure_in_percent_from_a_timeline_or_a_dict():
    tl = ipukit.simulate("1f1b", 4, 8, forward_cost=[1, 1, 2, 1], backward_cost=[2, 2, 4, 2])
    u = tl.utilisation()
    for source in (tl, u, {"per_ipu": u["per_ipu"], "overall": u["overall"]}):
        fig = plots.utilisation_figure(source)
        assert list(fig.data[0].x) == ["IPU 0", "IPU 1", "IPU 2", "IPU 3"]
        assert list(fig.data[0].y) == pytest.approx([100 * v for v in u["per_ipu"].values()])
        assert f"{100 * u['overall']:.1f}%" in fig.layout.title.text
        assert tuple(fig.layout.yaxis.range) == (0, 105)
    assert "modeled" in plots.utilisation_figure(tl).layout.title.text
    # from a timeline, its speed comes first
    timed = ipukit.simulate("1f1b", 2, 4, forward_cost=1e-3, backward_cost=2e-3, samples=160)
    sub = plots.utilisation_figure(timed).layout.title.text.split("<br>")[1]
    assert sub.index("ms per step") < sub.index("busy")
    assert f"{timed.throughput():,.0f} samples/s" in sub


def test_breakdown_figure_stacks_the_idle_parts_to_100_and_labels_speed():
    runs = {"pipelined": ipukit.simulate("1f1b", 4, 8, forward_cost=[1, 2, 1, 1], step_cost=2.0,
                                         host_overhead=3.0, samples=320),
            "sharded": ipukit.simulate("sharded", 4, 8, samples=320)}
    fig = plots.breakdown_figure(runs)
    assert [t.name for t in fig.data] == [label for _, label, _ in plots.BREAKDOWN_PARTS]
    for i, (name, tl) in enumerate(runs.items()):
        assert sum(t.x[i] for t in fig.data) == pytest.approx(100.0)
        assert fig.data[0].y[i].startswith(name) and "samples/s" in fig.data[0].y[i]
        shares = tl.idle_breakdown()["shares"]
        assert [t.x[i] for t in fig.data] == pytest.approx(
            [100 * shares[k] for k, _, _ in plots.BREAKDOWN_PARTS])


def test_schedule_grid_shows_both_schedules_bubble_and_stash():
    N, M = 4, 6
    fig = plots.schedule_grid_figure(N, M)
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("GPipe") and titles[1].startswith("1F1B")
    bubble = f"{100 * (N - 1) / (M + N - 1):.0f}%"
    assert all(bubble in t for t in titles[:2])
    idle = [t for t in fig.data if t.name == "idle (bubble)"]
    assert len(idle) == 2
    for trace in idle:          # idle cells of a unit grid: 2 (N - 1) units per row
        assert sum(trace.x) == pytest.approx(2 * (N - 1) * N)
    rows = [list(fig.layout.yaxis.categoryarray), list(fig.layout.yaxis2.categoryarray)]
    assert rows[0] == [f"stage {s} · holds {M}" for s in range(N)]         # GPipe stashes M
    assert rows[1] == [f"stage {s} · holds {N - s}" for s in range(N)]     # 1F1B stashes N - s
    assert not [t for t in fig.data if t.name == plots.LABELS["step"]]     # no host row
    forwards = [t for t in fig.data if t.name == "forward"]
    assert sorted(forwards[0].text, key=int) == sorted([str(m) for m in range(M)] * N, key=int)


def test_compare_stacks_measured_over_modeled_on_one_time_axis():
    measured = Timeline(ipukit.simulate("1f1b", 3, 4, forward_cost=1.1).events, modeled=False,
                        meta={"kind": "1f1b", "num_stages": 3, "micro_batches": 4})
    modeled = ipukit.simulate("1f1b", 3, 4)
    fig = plots.compare_figure(measured, modeled)
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("measured") and titles[1].startswith("modeled")
    assert {t.xaxis for t in fig.data} == {"x", "x2"}
    assert fig.layout.xaxis.matches == "x2"                 # shared time axis
    assert sum(len(t.x) for t in fig.data if t.xaxis == "x") == drawn_bars(measured)
    assert sum(len(t.x) for t in fig.data if t.xaxis == "x2") == drawn_bars(modeled)
    assert sum(1 for t in fig.data if t.showlegend) == 3    # one legend entry per kind


def _report(on_chip=True):
    stages = []
    for s in range(2):
        opt = 300 * (s + 1)
        stages.append({"stage": s, "ipu": s, "blocks": [f"B{s}"], "parameter_bytes": 100 * (s + 1),
                       "gradient_accumulator_bytes": 100 * (s + 1),
                       "optimizer_state_on_chip_bytes": opt if on_chip else 0,
                       "optimizer_state_host_bytes": 0 if on_chip else opt,
                       "activation_stash_bytes": 1000 * (2 - s), "micro_batches_in_flight": 2 - s})
    return MemoryReport(stages=stages, schedule_kind="1f1b", num_stages=2, micro_batches=4,
                        training=True)


def test_memory_figure_stacks_each_stage():
    fig = plots.memory_figure(_report())
    assert fig.layout.barmode == "stack"
    names = [t.name for t in fig.data]
    assert names == ["parameters", "gradient accumulators", "optimiser state", "activation stash"]
    totals = [sum(t.y[i] for t in fig.data) for i in range(2)]
    assert totals == pytest.approx([2500 / 1024, 2000 / 1024])     # KiB
    assert fig.layout.yaxis.title.text == "KiB"
    hosted = plots.memory_figure(_report(on_chip=False))
    assert "optimiser state (host memory)" in [t.name for t in hosted.data]
    assert "optimiser state" not in [t.name for t in hosted.data]


def test_loss_accuracy_curves():
    history = [{"step": 10 * i, "loss": 2.0 / (i + 1), "accuracy": 50 + i} for i in range(5)]
    history.append({"step": 50, "loss": 0.3, "accuracy": None})
    fig = plots.loss_accuracy_figure(history)
    loss, acc = fig.data
    assert list(loss.x) == [0, 10, 20, 30, 40, 50] and loss.y[-1] == 0.3
    assert list(acc.y) == [50, 51, 52, 53, 54] and acc.yaxis == "y2"
    fractions = plots.loss_accuracy_figure([{"step": 1, "loss": 1.0, "accuracy": 0.9}])
    assert fractions.data[1].y[0] == pytest.approx(90.0)


def test_every_figure_works_as_a_figure_widget():
    tl = ipukit.simulate("1f1b", 3, 4, host_overhead=0.2, step_cost=0.1)
    figures = [plots.timeline_figure(tl), plots.utilisation_figure(tl),
               plots.compare_figure(tl, tl), plots.memory_figure(_report()),
               plots.loss_accuracy_figure([]), plots.loss_accuracy_figure([{"step": 0, "loss": 1}]),
               plots.timeline_figure(Timeline()), plots.utilisation_figure(Timeline())]
    for fig in figures:
        widget = go.FigureWidget(fig)
        assert len(widget.data) == len(fig.data)


def test_a_measured_timeline_draws(tmp_path):
    from test_timeline import pipelined, SleepStack

    net = SleepStack(ms=(1.0, 1.0))
    model = ipukit.trainingModel(net, pipelined(2, gradientAccumulation=3))
    model(torch.randn(6, 8), torch.randn(6, 8))
    fig = plots.timeline_figure(model.getTimeline())
    assert len(by_name(fig)["forward"].x) == 6 and "measured" in fig.layout.title.text
    go.FigureWidget(fig)


def test_large_timelines_stay_cheap():
    """Bars are drawn as one trace per kind, never a trace, shape or label per bar."""
    big = plots.timeline_figure(ipukit.simulate("1f1b", 8, 256))          # 4104 bars
    small = plots.timeline_figure(ipukit.simulate("1f1b", 2, 2))
    assert len(big.data) == len(small.data)
    assert len(big.layout.shapes) == len(small.layout.shapes)
    assert len(big.layout.annotations) == len(small.layout.annotations)


def test_split_backward_passes_have_their_own_colours_and_legend_entries():
    tl = ipukit.simulate("zbv", 4, 4, forward_cost=1.0, backward_cost=2.0)
    traces = by_name(plots.timeline_figure(tl))
    i, w = plots.LABELS["input-grad"], plots.LABELS["weight-grad"]
    assert {"forward", i, w} <= set(traces) and "backward" not in traces
    colours = {traces[n].marker.color for n in ("forward", i, w)}
    assert len(colours | {plots.COLOURS["backward"], plots.COLOURS["step"]}) == 5
    assert len(traces[i].x) == len(traces[w].x) == 4 * 4
    assert sorted(set(traces[i].y)) == ["IPU 0", "IPU 1"]          # a V: 4 stages, 2 IPUs
    names = [t.name for t in plots.timeline_figure(tl).data]
    assert names.index("forward") < names.index(i) < names.index(w)    # F, I, W in order
    assert plots.schedule_name("zbv") == "ZBV" and plots.schedule_name("zb-h1") == "ZBH1"


def test_the_grid_of_a_zero_bubble_schedule_shades_only_idle_cells():
    fig = plots.schedule_grid_figure(4, 8, kinds=("1f1b", "zb-h1"), backward_cost=2.0)
    idle = [t for t in fig.data if t.name == "idle (bubble)"]
    shaded = [sum(t.x) for t in idle]
    assert shaded[1] < shaded[0]               # ZB-H1 fills 1F1B's bubble with W passes


def test_schedule_comparison_has_three_panels_of_bars_and_marks_the_selection():
    rows = [dict(schedule="1F1B", ipus=4, available=True, reason="", time_per_step=0.04,
                 bubble=0.25, peak_activations=4.0),
            dict(schedule="ZBV", ipus=2, available=True, reason="", time_per_step=0.05,
                 bubble=0.1, peak_activations=4.0),
            dict(schedule="DualPipeV", ipus=0, available=False, reason="needs an even number",
                 time_per_step=None, bubble=None, peak_activations=None)]
    fig = plots.schedule_comparison_figure(rows, selected="ZBV")
    assert [t.type for t in fig.data] == ["bar"] * 3
    time_, bubble, memory = fig.data
    assert list(time_.y)[:2] == pytest.approx([40.0, 50.0]) and list(time_.y)[2] is None
    assert list(bubble.y)[:2] == pytest.approx([25.0, 10.0])
    assert list(memory.y)[:2] == [4.0, 4.0]
    assert list(time_.x) == ["1F1B<br>4 IPUs", "ZBV<br>2 IPUs", "DualPipeV<br>—"]
    assert time_.marker.color[1] == plots.SELECTED_COLOUR != time_.marker.color[0]
    assert "needs an even number" in time_.customdata[2]
    go.FigureWidget(fig)                                 # works as a widget


def test_schedule_comparison_on_mixed_ipu_counts_says_so_and_gives_ipu_time():
    rows = [dict(schedule="1F1B", ipus=4, available=True, reason="", time_per_step=0.04,
                 bubble=0.25, peak_activations=4.0),
            dict(schedule="ZBV", ipus=2, available=True, reason="", time_per_step=0.05,
                 bubble=0.1, peak_activations=4.0)]
    fig = plots.schedule_comparison_figure(rows)
    assert "different numbers of IPUs" in fig.layout.title.text
    assert "160.0 IPU·ms" in fig.data[0].customdata[0]
    assert "100.0 IPU·ms" in fig.data[0].customdata[1]
    same = plots.schedule_comparison_figure([dict(rows[0]), dict(rows[1], ipus=4)])
    assert "different" not in same.layout.title.text


def test_compare_shows_the_models_notes():
    from ipukit.timeline.costs import CostTable, model_call

    t = CostTable(blocks=["a", "b"], forward=[1.0, 1.0], backward=[2.0, 2.0], cores=1)
    modeled = model_call(t, "1f1b", [["a"], ["b"]], 4)
    measured = Timeline(modeled.events, modeled=False, meta=dict(modeled.meta))
    fig = plots.compare_figure(measured, modeled)
    texts = [a.text for a in fig.layout.annotations]
    assert any(x.startswith("Model: ") and "at most 1 at once" in x for x in texts)


def test_a_legend_lists_every_kind_drawn_in_any_panel_once():
    """I and W drawn only in a later panel (a zero-bubble schedule) are in the legend too."""
    from ipukit.viz.plots import compare_figure, schedule_grid_figure

    for fig in (schedule_grid_figure(4, 8, kinds=["1f1b", "zb-h1"]),
                compare_figure(ipukit.simulate("1f1b", 3, 6), ipukit.simulate("zb-h1", 3, 6))):
        shown = [t.name for t in fig.data if t.showlegend is not False]
        assert len(shown) == len(set(shown))
        assert {"input gradient (I)", "weight gradient (W)", "forward", "backward"} <= set(shown)
