"""The explorer's logic (pure functions) and the dashboard driven headlessly."""
import threading
import time

import pytest
import torch

import ipukit
from ipukit.viz import plots
from ipukit.examples import mnist, vit as vit_example
from ipukit.examples.mnist import BLOCKS, Network, TrainingModelWithLoss
from ipukit.widgets import logic
from ipukit.widgets.logic import Config, CostTable

MODELS = [mnist.explorer_model(), vit_example.explorer_model()]
CONVNET, VIT = MODELS


def equal_costs(blocks=BLOCKS, forward=1.0, backward=2.0):
    """The same costs for every block, at any micro-batch size (``micro_batch`` 0)."""
    return CostTable(list(blocks), [forward] * len(blocks), [backward] * len(blocks),
                     notes={"source": "equal costs"})


def reference(micro_batch_size=40):
    """The convnet's reference table: numbers that do not depend on the machine."""
    return mnist.reference_costs(micro_batch_size)


# -- splits and configurations -------------------------------------------------------------

def test_contiguous_splits_most_stages_first():
    splits = logic.contiguous_splits(BLOCKS)
    assert len(splits) == 8
    labels = list(splits)
    assert labels[0] == "B1 | B2 | B3 | B4" and splits[labels[0]] == (0, 1, 2, 3)
    assert labels[-1] == "B1 B2 B3 B4" and splits[labels[-1]] == (0, 0, 0, 0)
    assert splits["B1 B2 | B3 B4"] == (0, 0, 1, 1)
    assert splits["B1 B2 B3 | B4"] == (0, 0, 0, 1)
    stages = [max(s) + 1 for s in splits.values()]
    assert stages == sorted(stages, reverse=True)
    for label, split in splits.items():
        assert logic.parse_split(label) == split
        assert logic.split_label(BLOCKS, split) == label


@pytest.mark.parametrize("label", ["B2 | B1 | B3 | B4", "B1 | | B2 B3 B4", "B1 B2 B3"])
def test_parse_split_rejects_bad_labels(label):
    with pytest.raises(ValueError):
        logic.parse_split(label)


def test_config_derived_values():
    c = Config(device_iterations=10, gradient_accumulation=10, micro_batch_size=40)
    assert c.combined_batch == 4000
    assert c.num_stages == 4 and c.schedule_kind == "1f1b"
    assert c.with_(schedule="GPipe").schedule_kind == "gpipe"
    assert c.with_(sharded=True).schedule_kind == "sharded"
    assert c.with_(split="B1 B2 | B3 B4").stage_blocks == [["B1", "B2"], ["B3", "B4"]]
    assert c.with_(output_mode="Default").resolved_output_mode == "Final"
    assert logic.host_calls_per_epoch(60000, c) == 15
    assert logic.host_calls_per_epoch(60000, c.with_(device_iterations=1)) == 150


def test_training_options_follow_the_controls():
    c = Config(device_iterations=3, gradient_accumulation=9, split="B1 B2 | B3 B4",
               output_mode="EveryN", output_return_period=3, schedule="GPipe",
               offload_optimizer=True)
    opts = logic.training_options(c)
    assert opts.device_iterations == 3
    assert opts.Training.gradient_accumulation == 9
    assert opts.output_mode == ipukit.OutputMode.EveryN and opts.output_return_period == 3
    assert opts.pipeline_schedule == "GPipe"
    assert not opts.TensorLocations.on_chip("optimizer")
    strategy = opts.execution_strategy
    assert type(strategy) is ipukit.PipelinedExecution
    assert [s.blocks for s in strategy.stages] == [["B1", "B2"], ["B3", "B4"]]
    sharded = logic.training_options(c.with_(sharded=True, output_mode="All"))
    assert isinstance(sharded.execution_strategy, ipukit.ShardedExecution)
    assert sharded.output_mode == ipukit.OutputMode.All
    assert logic.training_options(Config()).TensorLocations.on_chip("optimizer")


def test_custom_blocks_get_a_generic_strategy():
    c = Config(blocks=("a", "b", "c"), split="a b | c")
    strategy = logic.strategy_for(c)
    assert [s.blocks for s in strategy.stages] == [["a", "b"], ["c"]]


# -- the modeled view --------------------------------------------------------------------------

@pytest.mark.parametrize("ga", [7, 10, 32])
def test_gpipe_with_equal_costs_matches_the_formula(ga):
    c = Config(gradient_accumulation=ga, device_iterations=1, schedule="GPipe")
    view = logic.modeled_view(c, equal_costs(), 60000)
    n = 4
    assert view.overall == pytest.approx(ga / (ga + n - 1))
    assert view.bubble == pytest.approx(1 - ga / (ga + n - 1))
    assert sorted(view.utilisation) == [0, 1, 2, 3]


def contended_costs():
    """Costs as a run on a busy 2-core machine measures them: a slow first stage, a big step."""
    return CostTable(list(BLOCKS), [6e-3, 3e-3, 5e-4, 3e-4], [1.2e-2, 4e-3, 1e-3, 5e-4],
                     step=2e-2, host_before=1e-2, notes={"source": "a busy machine's costs"})


@pytest.mark.parametrize("costs", [reference(), contended_costs()],
                         ids=["reference", "busy-machine"])
@pytest.mark.parametrize("di", [1, 2])
def test_more_gradient_accumulation_is_faster_with_a_smaller_bubble(costs, di):
    """The law behind "GA 8 -> 64": fill, drain, step and host time are paid per step or per
    call, so more micro-batches per step spread them thinner. Busy work per sample is fixed,
    so utilisation rises with speed; with the optimiser step drawn as busy time on every IPU
    (before) it fell for a slow first stage and a costly step."""
    base = Config(device_iterations=di)
    views = [logic.modeled_view(base.with_(gradient_accumulation=ga), costs, 60000)
             for ga in (7, 8, 14, 28, 56, 64)]
    speed = [v.samples_per_second for v in views]
    assert speed == sorted(speed) and speed[-1] > speed[0]
    bubbles = [v.bubble for v in views]
    assert bubbles == sorted(bubbles, reverse=True)
    assert [v.breakdown["textbook_bubble"] for v in views] == pytest.approx(
        [3 / (ga + 3) for ga in (7, 8, 14, 28, 56, 64)])
    overall = [v.overall for v in views]
    assert overall == sorted(overall)
    per_ipu = [logic.bar_values(v.utilisation) for v in views]
    assert sum(per_ipu[-1]) > sum(per_ipu[1])          # what the browser test checks (8 -> 64)


def test_the_optimiser_step_is_host_time_in_the_model():
    costs = contended_costs()
    view = logic.modeled_view(Config(device_iterations=2, gradient_accumulation=8), costs, 60000)
    b = view.breakdown
    assert b["step"] == pytest.approx(4 * 2 * costs.step)      # 4 IPUs wait for 2 steps
    assert b["busy"] == pytest.approx(sum(
        e.duration for e in view.timeline.events if e.kind in ("forward", "backward")))
    assert b["bubble"] + b["imbalance"] + b["host"] + b["step"] == pytest.approx(b["idle"])


def test_device_iterations_amortise_host_overhead():
    costs = equal_costs()
    costs.host_before = 50.0
    u = [logic.modeled_view(Config(device_iterations=di), costs, 60000).overall
         for di in (1, 4, 16)]
    assert u[0] < u[1] < u[2]


def test_sharded_runs_one_ipu_at_a_time():
    view = logic.modeled_view(Config(sharded=True), equal_costs(), 60000)
    assert view.overall == pytest.approx(0.25)
    assert all(v == pytest.approx(0.25) for v in view.utilisation.values())


def test_the_busiest_split_is_not_the_fastest_with_reference_costs():
    """Issue 15's example: judged by speed, not by how busy the IPUs look."""
    costs = reference()
    config = Config(device_iterations=2, gradient_accumulation=8)
    four = logic.modeled_view(config.with_(split="B1 | B2 | B3 | B4"), costs, 60000)
    two = logic.modeled_view(config.with_(split="B1 | B2 B3 B4"), costs, 60000)
    one = logic.modeled_view(config.with_(split="B1 B2 B3 B4"), costs, 60000)
    assert one.overall > two.overall > four.overall                 # busiest ...
    assert four.samples_per_second > two.samples_per_second > one.samples_per_second  # ... slowest
    ranked = logic.rank_splits(config, costs)
    assert len(ranked) == 8
    speeds = [r["samples_per_second"] for r in ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert ranked[0]["samples_per_second"] >= four.samples_per_second
    assert ranked[-1]["split"] == "B1 B2 B3 B4"


def test_modeled_view_numbers():
    c = Config(device_iterations=2, gradient_accumulation=8, micro_batch_size=16)
    view = logic.modeled_view(c, reference(16), 60000)
    assert view.combined_batch == 256
    assert view.host_calls_per_epoch == 60000 // 256
    assert view.timeline.modeled and view.wall_time > 0
    assert view.samples_per_second == pytest.approx(256 / view.wall_time)
    assert view.title.startswith("Modeled") and "reference costs" in view.title
    assert logic.bar_values(view.utilisation) == [100 * view.utilisation[k] for k in range(4)]
    html = logic.format_summary(view)
    assert "256 samples" in html and "host calls per epoch" in html
    # speed first, then utilisation and the idle parts with the textbook bubble
    assert html.index("samples/s") < html.index("ms") < html.index("utilisation")
    assert "(N−1)/(M+N−1)" in html and "optimiser step" in html
    assert view.time_per_step == pytest.approx(view.wall_time / 2)


def test_offload_adds_step_time():
    c = Config()
    costs = reference()
    on = logic.modeled_timeline(c, costs, parameters=90_000)
    off = logic.modeled_timeline(c.with_(offload_optimizer=True), costs, parameters=90_000)
    assert off.wall_time > on.wall_time


def test_a_table_is_used_only_at_its_micro_batch_size():
    with pytest.raises(ValueError, match="micro-batches of 40"):
        logic.modeled_view(Config(micro_batch_size=16), reference(40), 60000)
    assert logic.modeled_view(Config(micro_batch_size=16), equal_costs(), 60000).wall_time > 0


def test_calibration_is_paid_once_per_model_and_micro_batch_size(monkeypatch):
    """Issue 26: the explorer's costs come from ipukit.calibrate on this machine, once."""
    import importlib

    calibrate_module = importlib.import_module("ipukit.calibrate")   # ipukit.calibrate: the function
    calls = []
    real = calibrate_module.calibrate

    def counting(*args, **kwargs):
        calls.append(kwargs.get("block_order"))
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "calibrate", counting)
    from ipukit.examples.spec import ModelSpec

    spec = ModelSpec("convnet", BLOCKS, Network, TrainingModelWithLoss)   # a new spec
    assert not logic.is_calibrated(spec, 8)
    table = logic.calibrated_costs(spec, 8, repeats=2)
    assert calls == [list(BLOCKS)] and logic.is_calibrated(spec, 8, repeats=2)
    assert logic.calibrated_costs(spec, 8, repeats=2) is table and len(calls) == 1
    assert table.blocks == list(BLOCKS) and table.micro_batch == 8
    assert logic.cost_source(table) == "costs calibrated on this machine"
    assert all(v > 0 for v in table.forward + table.backward)


def test_alike_blocks_share_their_calibrated_cost():
    """The ViT's encoder layers do the same work: each gets the group's median."""
    table = logic.calibrated_costs(VIT, 4, repeats=2)
    encoders = [i for i, b in enumerate(table.blocks) if b.startswith("Encoder")]
    assert len(encoders) == 8
    for costs in (table.forward, table.backward):
        assert len({costs[i] for i in encoders}) == 1


def test_large_calls_are_clipped_for_drawing():
    c = Config(device_iterations=64, gradient_accumulation=64)
    view = logic.modeled_view(c, reference(), 60000)
    assert len(view.timeline.events) > logic.MAX_DRAWN_EVENTS
    assert len(view.drawn.events) <= logic.MAX_DRAWN_EVENTS
    assert "device iterations drawn" in view.drawn_note
    small = logic.modeled_view(Config(), reference(), 60000)
    assert small.drawn is small.timeline and small.drawn_note == ""


# -- output modes ----------------------------------------------------------------------------

def test_returned_micro_batches_per_output_mode():
    c = Config(device_iterations=2, gradient_accumulation=3)
    assert logic.returned_micro_batches(c.with_(output_mode="All")) == list(range(6))
    assert logic.returned_micro_batches(c.with_(output_mode="Final")) == [5]
    assert logic.returned_micro_batches(c.with_(output_mode="Default")) == [5]
    assert logic.returned_micro_batches(c.with_(output_mode="EveryN",
                                                output_return_period=2)) == [1, 3, 5]
    assert logic.returned_micro_batches(c.with_(output_mode="Sum")) is None


def test_call_metrics_use_the_matching_labels():
    c = Config(device_iterations=2, gradient_accumulation=3, micro_batch_size=2)
    labels = torch.arange(12) % 10
    perfect = torch.nn.functional.one_hot(labels, 10).float()
    all_ = logic.call_metrics(perfect, torch.ones(6), labels, c.with_(output_mode="All"))
    assert all_ == {"loss": 1.0, "accuracy": 100.0, "predictions": 12}
    final = logic.call_metrics(perfect[-2:], torch.tensor(0.5), labels,
                               c.with_(output_mode="Final"))
    assert final["predictions"] == 2 and final["accuracy"] == 100.0
    every = c.with_(output_mode="EveryN", output_return_period=3)
    chosen = torch.cat([perfect[4:6], perfect[10:12]])
    assert logic.call_metrics(chosen, torch.ones(2), labels, every)["accuracy"] == 100.0
    wrong = logic.call_metrics(perfect[:4], torch.ones(2), labels, every)
    assert wrong["accuracy"] < 100.0
    summed = logic.call_metrics(perfect[:2] * 6, torch.tensor(6.0), labels,
                                c.with_(output_mode="Sum"))
    assert summed == {"loss": 1.0, "accuracy": None, "predictions": 0}


def test_error_html_escapes_and_is_empty_without_message():
    assert logic.error_html(None) == ""
    html = logic.error_html("GA <3> too small")
    assert "&lt;3&gt;" in html and "reject" in html


# -- probing with ipukit -------------------------------------------------------------------

TEMPLATE = [torch.zeros(1, 28, 28), torch.zeros((), dtype=torch.long)]


def test_probe_reports_what_popTorch_rejects():
    net = Network()
    bad = logic.probe(Config(gradient_accumulation=3, device_iterations=1), net,
                      TrainingModelWithLoss, TEMPLATE)
    assert not bad.ok and bad.error_type == "PipelineConfigError"
    assert "gradientAccumulation" in bad.error and "(7)" in bad.error
    # the same module can be probed again right away: the probe unwraps it
    period = logic.probe(Config(device_iterations=2, gradient_accumulation=8,
                                output_mode="EveryN", output_return_period=3), net,
                         TrainingModelWithLoss, TEMPLATE)
    assert not period.ok and "divide" in period.error
    sharded = logic.probe(Config(gradient_accumulation=3, device_iterations=1, sharded=True),
                          net, TrainingModelWithLoss, TEMPLATE)
    assert sharded.ok


def test_probe_gives_a_memory_report_per_stage():
    net = Network()
    ok = logic.probe(Config(split="B1 B2 | B3 B4", gradient_accumulation=8, device_iterations=1,
                            micro_batch_size=8), net, TrainingModelWithLoss, TEMPLATE)
    assert ok.ok and ok.stage_blocks == [["B1", "B2"], ["B3", "B4"]]
    assert ok.parameters == sum(p.numel() for p in net.parameters())
    stages = ok.report.stages
    assert [st["parameters"] for st in stages] == [260 + 5020, 82176 + 2570]
    offloaded = logic.probe(Config(split="B1 B2 | B3 B4", gradient_accumulation=8,
                                   device_iterations=1, micro_batch_size=8,
                                   offload_optimizer=True), net, TrainingModelWithLoss, TEMPLATE)
    assert (offloaded.report.total("optimizer_state_on_chip_bytes") == 0
            < ok.report.total("optimizer_state_on_chip_bytes"))


def test_all_and_final_outputs_of_a_real_call():
    """All returns a prediction per sample of the combined batch; Final only the last micro-batch."""
    c = Config(device_iterations=2, gradient_accumulation=7, micro_batch_size=4)
    x = torch.randn(c.combined_batch, 1, 28, 28)
    y = torch.randint(0, 10, (c.combined_batch,))
    counts = {}
    for mode in ("All", "Final"):
        cfg = c.with_(output_mode=mode)
        net = Network()
        model = ipukit.trainingModel(TrainingModelWithLoss(net), logic.training_options(cfg))
        preds, losses = model(x, y)
        metrics = logic.call_metrics(preds, losses, y, cfg)
        counts[mode] = metrics["predictions"]
        assert metrics["accuracy"] is not None
        model.destroy()
    assert counts == {"All": c.combined_batch, "Final": c.micro_batch_size}


# -- the dashboard, headless -------------------------------------------------------------------

@pytest.fixture
def explorer():
    pytest.importorskip("ipywidgets")
    from ipukit.widgets import PipelineExplorer

    g = torch.Generator().manual_seed(0)
    train = torch.utils.data.TensorDataset(torch.randn(960, 1, 28, 28, generator=g),
                                           torch.randint(0, 10, (960,), generator=g))
    test = torch.utils.data.TensorDataset(torch.randn(160, 1, 28, 28, generator=g),
                                          torch.randint(0, 10, (160,), generator=g))
    ex = PipelineExplorer(MODELS, train_dataset=train, test_dataset=test, calls=2,
                          config=Config(device_iterations=2, gradient_accumulation=8,
                                        micro_batch_size=8))
    yield ex
    ex.close()


def test_a_verdict_on_the_drawn_view_redraws_only_what_it_changes(explorer):
    """ipukit's verdict arrives after the view is drawn: it redraws the memory figure, and the
    timeline's title when it rejects; the utilisation and every-schedule figures stay."""
    import dataclasses

    d, m = explorer.dashboard, explorer.modeler
    accepted = explorer.probe_result                    # waits for the verdict
    kept = {n: d.figures[n].data[0] for n in ("modeled utilisation", "schedules")}
    d.show_modeled(m.view, dataclasses.replace(accepted, error="boom"), m.rows)
    assert all(d.figures[n].data[0] is trace for n, trace in kept.items())
    assert d.figures["modeled timeline"].layout.title.text.startswith(
        m.view.title + " — PopTorch rejects this configuration")
    d.show_modeled(m.view, accepted, m.rows)
    assert "rejects" not in d.figures["modeled timeline"].layout.title.text
    explorer.set(gradient_accumulation=16)               # a new view: every figure again
    assert all(d.figures[n].data[0] is not trace for n, trace in kept.items())


def test_each_figure_is_its_boxs_one_plotly_output(explorer):
    """A box holds its figure as a plotly mime output (no plotly widget bundle in the saved
    widget state), laid out at the box's width and at its own height."""
    box = explorer.dashboard._boxes["memory"]
    (out,) = box.outputs
    figure = out["data"]["application/vnd.plotly.v1+json"]
    assert figure["layout"]["height"] == 360 and "width" not in figure["layout"]
    assert [t["type"] for t in figure["data"]] == [t.type for t in explorer.memory_figure.data]
    assert box.layout.width == "500px"


def test_explorer_modeled_view_follows_controls(explorer):
    assert explorer.last_error is None
    assert explorer.config.combined_batch == 128
    assert explorer.host_calls_per_epoch == 960 // 128
    before = explorer.modeled_overall
    explorer.gradient_accumulation.value = 32
    assert explorer.modeled_overall > before
    bars = explorer.modeled_utilisation_figure.data[0]
    assert list(bars.y) == pytest.approx(logic.bar_values(explorer.modeled_utilisation))
    assert len(bars.y) == 4
    assert "costs calibrated on this machine" in explorer.modeled_timeline_figure.layout.title.text
    explorer.split.value = "B1 B2 | B3 B4"
    assert len(explorer.modeled_utilisation_figure.data[0].y) == 2
    assert len(explorer.memory_figure.data) > 0
    explorer.set(sharded=True)
    assert explorer.schedule.disabled
    assert explorer.modeled_overall == pytest.approx(
        logic.modeled_view(explorer.config, explorer.costs, 960).overall)


def test_explorer_shows_rejected_combinations_and_recovers(explorer):
    explorer.set(device_iterations=1, gradient_accumulation=3)
    assert explorer.last_error and "gradientAccumulation" in explorer.last_error
    assert "moved in any order" in explorer.last_error          # what to change, either way
    assert "gradientAccumulation" in explorer.error.value
    assert "rejects" in explorer.modeled_timeline_figure.layout.title.text
    records = explorer.run(calls=1)          # running it shows the same error, no crash
    assert records == [] and "gradientAccumulation" in explorer.last_error
    assert not explorer.run_button.disabled
    explorer.gradient_accumulation.value = 8
    assert explorer.last_error is None and explorer.error.value == ""


def test_explorer_run_updates_measured_figures(explorer):
    before = explorer.measured_utilisation_figure.to_dict()["data"]
    records = explorer.run(calls=2)
    assert len(records) == 2 and explorer.history == records
    assert [r["call"] for r in records] == [1, 2]
    assert all(r["predictions"] == 128 for r in records)          # All: every micro-batch
    util = explorer.measured_utilisation
    assert sorted(util) == [0, 1, 2, 3]
    bars = explorer.measured_utilisation_figure.data[0]
    assert explorer.measured_utilisation_figure.to_dict()["data"] != before
    assert list(bars.y) == pytest.approx([100 * util[k] for k in sorted(util)])
    assert util == explorer.measured_timeline.utilisation()["per_ipu"]
    assert explorer.modeled.cost_source == "costs calibrated on this machine"
    assert explorer.test_accuracy is not None
    assert len(explorer.training_figure.data[0].x) == 2
    explorer.output_mode.value = "Final"
    final = explorer.run(calls=1)
    assert final[0]["predictions"] == 8 and final[0]["call"] == 3


def test_explorer_background_run_stops_cleanly(explorer):
    explorer.evaluate_after_run = False
    explorer.start(calls=10_000)
    assert explorer.running and explorer.stop_button.disabled is False
    deadline = time.time() + 60
    while not explorer.history and time.time() < deadline:
        time.sleep(0.05)
    explorer.stop(wait=True)
    assert not explorer.running
    assert 1 <= len(explorer.history) < 10_000
    assert not explorer.run_button.disabled and explorer.stop_button.disabled
    names = [t.name for t in threading.enumerate()]
    assert "ipukit-explorer" not in names
    assert not [n for n in names if n.startswith("ipukit-ipu")]


def test_explorer_reset_forgets_training(explorer):
    explorer.run(calls=1)
    explorer.reset()
    assert explorer.history == [] and explorer.measured_utilisation == {}
    # the measured figures are emptied too: no panel shows a call the controls do not describe
    assert not explorer.measured_utilisation_figure.data
    assert not explorer.measured_timeline_figure.data
    assert "press Run" in explorer.measured_utilisation_figure.layout.title.text


def test_a_run_with_nothing_changed_keeps_the_calibrated_model(explorer):
    """Issue 26: the modeled headline before a Run comes from the table calibrated on this
    machine, and a Run with nothing changed models from that same table (not from costs of
    another source), so the number the notebook says to judge by does not jump."""
    config = explorer.config
    table = logic.calibrated_costs(explorer.models["convnet"], config.micro_batch_size)
    assert explorer.costs is table
    before = explorer.modeled
    assert before.cost_source == "costs calibrated on this machine"
    assert before.samples_per_second == pytest.approx(
        logic.modeled_view(config, table, explorer.samples_per_epoch,
                           explorer.probe_result.parameters).samples_per_second)
    assert len(explorer.run(calls=1)) == 1 and explorer.last_error is None, explorer.last_error
    after = explorer.modeled
    assert explorer.costs is table and after.cost_source == before.cost_source
    assert after.config == before.config
    assert after.samples_per_second == pytest.approx(before.samples_per_second)
    figure = explorer.measured_timeline_figure
    assert "modeled from the calibrated costs" in figure.layout.title.text


def test_the_explorer_receives_its_models():
    """The dashboard imports no example: the models are given (issue 24)."""
    import pathlib
    import re

    folder = pathlib.Path(ipukit.__file__).parent / "widgets"
    for path in folder.glob("*.py"):
        code = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+(ipukit\.|\.\.)examples", code, re.M), path.name
    pytest.importorskip("ipywidgets")
    from ipukit.widgets import PipelineExplorer

    with pytest.raises(TypeError, match="not a model spec"):
        PipelineExplorer([object()])
    with pytest.raises(ValueError, match="at least one model spec"):
        PipelineExplorer([])


def test_logic_needs_no_ipywidgets():
    import subprocess
    import sys

    code = ("import sys, ipukit.widgets.logic, ipukit.widgets.session, ipukit.widgets.models, "
            "ipukit.widgets.comparison, ipukit.widgets.data; "
            "assert 'ipywidgets' not in sys.modules, 'logic imported ipywidgets'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_explorer_displays_as_its_widget(explorer):
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == explorer.widget.model_id


def test_explorer_works_with_another_model():
    pytest.importorskip("ipywidgets")
    from helpers import StackNet, make_data

    from ipukit.examples.spec import ModelSpec
    from ipukit.widgets import PipelineExplorer

    x, y = make_data(512)
    spec = ModelSpec("stack", ("b0", "b1", "b2", "b3"), lambda: StackNet(with_ipu_ids=False),
                     sample_shape=(8,), classes=4)
    ex = PipelineExplorer([spec], sample_shape=(8,),
                          train_dataset=torch.utils.data.TensorDataset(x, y),
                          test_dataset=torch.utils.data.TensorDataset(x[:64], y[:64]),
                          config=logic.example_config(spec, split="b0 b1 | b2 b3",
                                                      device_iterations=1,
                                                      gradient_accumulation=4,
                                                      micro_batch_size=8))
    try:
        assert list(ex.splits)[0] == "b0 | b1 | b2 | b3" and ex.model.value == "stack"
        assert ex.last_error is None and len(ex.modeled_utilisation) == 2
        assert ex.costs.blocks == ["b0", "b1", "b2", "b3"]        # calibrated on this machine
        records = ex.run(calls=2)
        assert len(records) == 2 and ex.last_error is None
        assert sorted(ex.measured_utilisation) == [0, 1]
        assert ex.test_accuracy is not None
    finally:
        ex.close()


def test_a_training_set_smaller_than_a_call_is_reported(explorer):
    explorer.set(device_iterations=64, gradient_accumulation=64)     # 32,768 samples per call
    assert explorer.last_error is None                               # PopTorch accepts it...
    assert explorer.run(calls=1) == []                               # ...but 960 samples are too few
    assert "smaller than one host call" in explorer.last_error
    assert "The run failed" in explorer.error.value
    explorer.device_iterations.value = 2
    assert explorer.last_error is None


# -- the ViT, placed by layers_per_ipu -----------------------------------------------------

def vit_config(layers=(2, 2, 2, 2), **values):
    return logic.example_config(VIT, layers_per_ipu=layers, **values)


def test_layers_per_ipu_text_parses_and_rejects_clearly():
    from ipukit.widgets.models import LayersPerIpuError, parse_layers

    vit = VIT
    assert parse_layers("2, 2, 2, 2", vit) == (2, 2, 2, 2)
    assert parse_layers("[3 -1 -1]", vit) == (3, -1, -1)
    for bad in ("", "2, x", "two"):
        with pytest.raises(LayersPerIpuError, match="one whole number per IPU"):
            parse_layers(bad, vit)
    assert issubclass(LayersPerIpuError, ipukit.Error)


@pytest.mark.parametrize("layers, stages", [((2, 2, 2, 2), 4), ((1,) * 8, 8), ((-1, -1, -1), 3),
                                            ((3, -1, -1), 3), ((0, 4, 4), 3), ((4, 0, 4), 2),
                                            ((8,), 1)])
def test_vit_placement_is_what_parallelize_and_the_compiler_do(layers, stages):
    """The explorer reads the split off the model's own parallelize(IPUConfig); compiling the
    same configuration gives the same stages, blocks and IPUs."""
    from ipukit.examples.vit import ViT

    config = vit_config(layers, gradient_accumulation=max(1, 2 * stages - 1), device_iterations=1,
                        micro_batch_size=4)
    assert config.num_stages == stages
    expected = ipukit.get_layer_ipu(ipukit.IPUConfig(layers_per_ipu=list(layers),
                                                     ipus_per_replica=len(layers)), 8)
    encoders = [ipu for block, ipu in zip(config.blocks, [config.stage_ipus[s] for s in config.split_ids])
                if block.startswith("Encoder")]
    assert encoders == expected
    result = logic.probe(config, ViT(num_layers=8), lambda m: m,
                         [torch.zeros(1, 28, 28), torch.zeros((), dtype=torch.long)])
    assert result.ok, result.error
    assert [list(st["blocks"]) for st in result.report.stages] == config.stage_blocks
    assert tuple(st["ipu"] for st in result.report.stages) == config.stage_ipus


def test_vit_options_come_from_its_ipu_config():
    config = vit_config(device_iterations=3, gradient_accumulation=9, offload_optimizer=True,
                        output_mode="EveryN", output_return_period=3)
    opts = logic.training_options(config)
    assert opts.device_iterations == 3 and opts.Training.gradient_accumulation == 9
    assert opts.output_mode == ipukit.OutputMode.EveryN and opts.output_return_period == 3
    assert not opts.TensorLocations.on_chip("optimizer")
    assert isinstance(opts.execution_strategy, ipukit.PipelinedExecution)
    assert opts.execution_strategy.stages == []          # the blocks' ipu_ids place the stages
    sharded = logic.training_options(config.with_(sharded=True))
    assert isinstance(sharded.execution_strategy, ipukit.ShardedExecution)
    with pytest.raises(ipukit.Error, match="places 6 layers but the model has 8"):
        vit_config((2, 2, 2))


def test_the_vit_pipelines_better_than_the_convnet_with_reference_costs():
    """Issue 13: the ViT's modeled utilisation for [2, 2, 2, 2] is well above the convnet's
    4-stage split (identical layers balance; two convolutions do not)."""
    settings = dict(device_iterations=1, gradient_accumulation=8, micro_batch_size=16)
    vit = logic.modeled_view(vit_config(**settings), VIT.reference_costs(16), 60000)
    conv = logic.modeled_view(Config(**settings), reference(16), 60000)
    assert vit.overall > conv.overall + 0.15
    assert vit.breakdown["shares"]["imbalance"] < conv.breakdown["shares"]["imbalance"] / 3
    assert max(vit.utilisation.values()) - min(vit.utilisation.values()) < 0.2


def test_explorer_switches_to_the_vit_and_back(explorer):
    assert explorer.model.value == "convnet" and explorer.layers_per_ipu.layout.display == "none"
    explorer.set(model="ViT")
    assert explorer.split.layout.display == "none" and explorer.layers_per_ipu.layout.display is None
    assert explorer.config.layers_per_ipu == (2, 2, 2, 2) and explorer.config.num_stages == 4
    assert explorer.last_error is None
    assert [st["blocks"] for st in explorer.probe_result.report.stages] == explorer.config.stage_blocks
    assert "Encoder" in " ".join(explorer.costs.blocks)
    bars = explorer.modeled_utilisation_figure.data[0]
    assert list(bars.y) == pytest.approx(logic.bar_values(explorer.modeled_utilisation))
    explorer.layers_per_ipu.value = "3, -1, -1"
    assert explorer.config.stage_blocks[0] == ["Embedding", "Encoder0", "Encoder1", "Encoder2"]
    assert len(explorer.modeled_utilisation_figure.data[0].y) == 3
    explorer.set(model="convnet")
    assert explorer.config.split == "B1 | B2 | B3 | B4" and explorer.last_error is None


def test_explorer_rejects_layers_that_do_not_fit_and_keeps_the_view(explorer):
    explorer.set(model="ViT")
    before = explorer.modeled
    explorer.layers_per_ipu.value = "2, 2, 2"
    assert "places 6 layers but the model has 8" in explorer.last_error
    assert "places 6 layers" in explorer.error.value and explorer.modeled is before
    assert explorer.run(calls=1) == [] and "places 6 layers" in explorer.last_error
    explorer.layers_per_ipu.value = "two"
    assert "one whole number per IPU" in explorer.last_error
    explorer.layers_per_ipu.value = "4, 4"
    assert explorer.last_error is None and explorer.config.num_stages == 2


def test_explorer_trains_the_vit(explorer):
    explorer.set(model="ViT", device_iterations=1, gradient_accumulation=7, micro_batch_size=8)
    records = explorer.run(calls=1)
    assert len(records) == 1 and explorer.last_error is None, explorer.last_error
    assert sorted(explorer.measured_utilisation) == [0, 1, 2, 3]
    assert explorer.modeled.cost_source == "costs calibrated on this machine"
    assert explorer.costs.blocks == list(explorer.config.blocks)
    assert explorer.test_accuracy is not None
    explorer.set(model="convnet")                     # another model: its own, empty history
    assert explorer.history == [] and explorer.costs.blocks == list(BLOCKS)


def test_the_verdict_arrives_in_the_background(explorer):
    explorer.set(gradient_accumulation=9)       # a configuration not compiled yet
    assert explorer.modeled.config.gradient_accumulation == 9      # modeled at once
    result = explorer.wait_for_verdict()
    assert result is not None and result.ok and not explorer.modeler.prober.pending
    assert explorer.probe_result is result


def test_no_class_of_the_widgets_is_over_about_200_lines():
    """Issue 10's rule for ipukit/widgets: classes split along their seams."""
    import ast
    import pathlib

    for path in pathlib.Path(ipukit.__file__).parent.joinpath("widgets").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= 215, f"{path.name}: class {node.name} has {lines} lines"


def test_the_parts_attributes_reach_the_explorer_unambiguously(explorer):
    """explorer.<name> is looked up in its parts: a name two parts share must be the explorer's
    own (explorer.wait is the run's, not the verdict's)."""
    parts = ("controls", "dashboard", "modeler", "runner", "data", "suggester")
    owners = {}
    for part in parts:
        for name in dir(getattr(explorer, part)):
            if not name.startswith("_"):
                owners.setdefault(name, []).append(part)
    own = set(dir(type(explorer))) | set(vars(explorer))
    shared = {n: p for n, p in owners.items() if len(p) > 1 and n not in own}
    assert not shared, shared
    assert explorer.wait == explorer.runner.wait and explorer.error is explorer.dashboard.error


def test_redraw_sends_every_figure_again_whole(explorer):
    sent = []
    for name, box in explorer.dashboard._boxes.items():
        box.observe(lambda change, name=name: sent.append(name) if change["new"] else None,
                    "outputs")
    before = explorer.modeled_utilisation_figure.to_dict()["data"]
    explorer.redraw()
    assert set(sent) == set(explorer.figures) and len(explorer.figures) == 7
    assert explorer.modeled_utilisation_figure.to_dict()["data"] == before


# -- every schedule: the selector and the comparison ---------------------------------------

def test_schedules_place_the_stages_as_ipukit_says():
    from ipukit.schedules.generators import placement

    four = Config()
    assert logic.placed(four.with_(schedule="ZBV")).stage_ipus == (0, 1, 1, 0)
    assert logic.placed(four.with_(schedule="Interleaved1F1B")).stage_ipus == (0, 1, 0, 1)
    assert logic.placed(four.with_(schedule="ZBH1")).stage_ipus == (0, 1, 2, 3)
    assert logic.placed(four.with_(schedule="ZBV", sharded=True)).stage_ipus == (0, 1, 2, 3)
    vit = vit_config((1,) * 8, schedule="DualPipeV")
    assert vit.stage_ipus == tuple(placement("dualpipev", 8))
    with pytest.raises(ValueError, match="even number of stages"):
        logic.placed(four.with_(split="B1 | B2 | B3 B4", schedule="ZBV"))
    strategy = logic.strategy_for(logic.placed(four.with_(schedule="ZBV")))
    assert [(s.blocks, s._ipu) for s in strategy.stages] == [
        (["B1"], 0), (["B2"], 1), (["B3"], 1), (["B4"], 0)]
    opts = logic.training_options(vit)           # the ViT: an explicit V over its 8 stages
    assert [s._ipu for s in opts.execution_strategy.stages] == list(placement("dualpipev", 8))
    assert opts.pipeline_schedule == "DualPipeV"


@pytest.mark.parametrize("costs", [equal_costs(), reference()], ids=["equal", "reference"])
def test_the_comparison_is_the_cost_model_for_every_schedule(costs):
    from ipukit.schedules.generators import LOOPED, V_SHAPED, placement
    from ipukit.timeline.costs import model_call
    from ipukit.widgets.comparison import schedule_rows

    config = Config(device_iterations=1, gradient_accumulation=8)
    rows = schedule_rows(config, costs, 60000)
    assert [r.schedule for r in rows] == list(logic.SCHEDULES)
    for row in rows:
        assert row.available, row.reason
        ipus = placement(row.kind, 4) if row.kind in LOOPED + V_SHAPED else list(range(4))
        tl = model_call(costs, row.kind, config.stage_blocks, 8, stage_ipus=ipus, samples=320,
                        cores=4)
        assert row.time_per_step == pytest.approx(tl.time_per_step()), row.schedule
        assert row.bubble == pytest.approx(tl.idle_breakdown()["shares"]["bubble"])
        assert row.ipus == len(set(ipus))
    by = {r.schedule: r for r in rows}
    assert by["GPipe"].peak_activations == 8 and by["1F1B"].peak_activations == 4


def test_zero_bubble_schedules_model_smaller_bubbles_with_equal_costs():
    from ipukit.widgets.comparison import schedule_rows

    by = {r.schedule: r for r in schedule_rows(Config(device_iterations=1, gradient_accumulation=16),
                                              equal_costs(backward=2.0), 60000)}
    assert by["ZBH1"].bubble < by["1F1B"].bubble and by["ZBH1"].time_per_step < by["1F1B"].time_per_step
    assert by["ZBV"].bubble < by["1F1B"].bubble / 2
    assert by["ZBH1"].peak_activations == by["1F1B"].peak_activations      # the same memory
    assert by["GPipe"].peak_activations == 16


def test_explorer_schedule_selector_and_comparison(explorer):
    from ipukit.widgets.comparison import schedule_rows

    explorer.set(schedule="ZBV")
    assert explorer.config.stage_ipus == (0, 1, 1, 0) and explorer.last_error is None
    kinds = {e.kind for e in explorer.modeled.timeline.events}
    assert {"input-grad", "weight-grad"} <= kinds and "backward" not in kinds
    names = {t.name for t in explorer.modeled_timeline_figure.data}
    assert {plots.LABELS["input-grad"], plots.LABELS["weight-grad"]} <= names
    assert sorted(explorer.modeled_utilisation) == [0, 1]
    rows = schedule_rows(explorer.config, explorer.costs, explorer.samples_per_epoch,
                         explorer.probe_result.parameters)
    drawn = explorer.figures["schedules"].data
    assert list(drawn[0].y) == pytest.approx([1e3 * r.time_per_step for r in rows])
    assert list(drawn[1].y) == pytest.approx([100 * r.bubble for r in rows])
    assert list(drawn[2].y) == pytest.approx([r.peak_activations for r in rows])
    selected = list(logic.SCHEDULES).index("ZBV")
    assert drawn[0].marker.color[selected] == plots.SELECTED_COLOUR
    row = rows[selected]
    assert row.time_per_step == pytest.approx(explorer.modeled.time_per_step)
    # three stages cannot make a V: the controls' error, the comparison says which cannot run
    explorer.split.value = "B1 | B2 | B3 B4"
    assert "even number of stages" in explorer.last_error
    explorer.schedule.value = "1F1B"
    assert explorer.last_error is None
    unavailable = [r.schedule for r in explorer.modeler.rows if not r.available]
    assert unavailable == ["ZBV", "DualPipeV"]


def test_explorer_runs_a_zero_bubble_schedule_and_draws_it_over_its_model(explorer):
    explorer.set(schedule="ZBH1", device_iterations=1, gradient_accumulation=4)
    records = explorer.run(calls=1)
    assert len(records) == 1 and explorer.last_error is None, explorer.last_error
    kinds = {e.kind for e in explorer.measured_timeline.events}
    assert {"input-grad", "weight-grad"} <= kinds
    figure = explorer.measured_timeline_figure
    assert "measured, and modeled from the calibrated costs" in figure.layout.title.text
    names = {t.name for t in figure.data}
    assert {plots.LABELS["input-grad"], plots.LABELS["weight-grad"], "forward"} <= names
    explorer.set(schedule="Interleaved1F1B")
    records = explorer.run(calls=1)
    assert len(records) == 1 and explorer.last_error is None, explorer.last_error
    assert sorted(explorer.measured_utilisation) == [0, 1]


def test_a_session_made_while_not_evaluating_evaluates_later():
    pytest.importorskip("ipywidgets")
    from ipukit.widgets import PipelineExplorer

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(400, 1, 28, 28, generator=g),
                                          torch.randint(0, 10, (400,), generator=g))
    ex = PipelineExplorer(MODELS, train_dataset=data, test_dataset=data, evaluate=False,
                          config=Config(device_iterations=1, gradient_accumulation=8,
                                        micro_batch_size=8))
    try:
        ex.run(calls=1)
        assert ex.test_accuracy is None
        ex.evaluate_after_run = True
        ex.run(calls=1)
        assert ex.test_accuracy is not None
    finally:
        ex.close()


def test_the_docs_table_of_schedules_is_the_simulators():
    """docs/schedules.md "Bubble and memory of every schedule": regenerate with
    ``python -m ipukit.widgets.comparison``."""
    import pathlib

    from ipukit.widgets.comparison import schedule_table

    page = pathlib.Path(__file__).resolve().parents[1].joinpath("docs", "schedules.md")
    text = page.read_text(encoding="utf-8")
    assert "## Bubble and memory of every schedule" in text
    table = schedule_table()
    assert table in text
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "27.3 %" in rows['`"1F1B"`'] and "11.1 %" in rows['`"ZBH1"`']      # a third left


def test_the_controls_can_be_moved_in_any_order(explorer):
    """Eight stages typed under 1F1B at GA 8 are refused (PopTorch: GA >= 15) with what to
    change; choosing ZBV afterwards ends where choosing it first does."""
    explorer.set(model="ViT", device_iterations=1, gradient_accumulation=8, micro_batch_size=8)
    explorer.layers_per_ipu.value = "1, 1, 1, 1, 1, 1, 1, 1"
    assert "(15)" in explorer.last_error and "ZBV" in explorer.last_error
    explorer.schedule.value = "ZBV"
    assert explorer.last_error is None and explorer.error.value == ""
    after = explorer.config
    explorer.set(layers_per_ipu="2, 2, 2, 2", schedule="1F1B")
    explorer.schedule.value = "ZBV"
    explorer.layers_per_ipu.value = "1, 1, 1, 1, 1, 1, 1, 1"
    assert explorer.config == after and explorer.last_error is None


def test_explorer_trains_the_vit_on_a_v_of_eight_one_layer_stages(explorer):
    from ipukit.schedules.generators import placement

    explorer.set(model="ViT", layers_per_ipu="1, 1, 1, 1, 1, 1, 1, 1", schedule="ZBV",
                 device_iterations=1, gradient_accumulation=4, micro_batch_size=8)
    assert explorer.config.stage_ipus == tuple(placement("zbv", 8))
    assert explorer.last_error is None
    records = explorer.run(calls=1)
    assert len(records) == 1 and explorer.last_error is None, explorer.last_error
    assert sorted(explorer.measured_utilisation) == [0, 1, 2, 3]
    stages = {(e.stage, e.ipu) for e in explorer.measured_timeline.device_events() if e.stage >= 0}
    assert stages == set(enumerate(placement("zbv", 8)))


# -- Suggest: ipukit.plan for the current model, IPUs and global batch -----------------------

def test_suggest_applies_the_plan_to_the_controls(explorer):
    """Issue 27: Suggest asks ipukit.plan (here on the convnet's reference tables, so the plan
    does not depend on this machine) and the controls then describe the plan."""
    tables = [reference(8), reference(40)]
    free = explorer.suggest(costs=tables)                      # empty box: no limit
    assert free is not None and free.memory_budget is None and explorer.suggest_error is None
    assert free.ipus == 4 and free.global_batch == 64 and free.recompute == []
    # a budget below the free plan's peak: a plan that fits, applied to every control
    budget = round(0.9 * free.peak_memory / 2 ** 20, 3)
    best = explorer.suggest(budget_mib=budget, costs=tables)
    assert best is explorer.suggested and best.peak_memory <= budget * 2 ** 20
    assert best.global_batch == 64 and best.memory_budget == [int(budget * 2 ** 20)] * 4
    label = logic.split_label(BLOCKS, [s for s, k in enumerate(best.split) for _ in range(k)])
    config = explorer.config
    assert (config.split, config.schedule, config.micro_batch_size, config.gradient_accumulation,
            config.device_iterations, config.sharded) == (
        label, best.title, best.micro_batch, best.gradient_accumulation, 2, False)
    assert explorer.modeled.config == config                     # the modeled panels follow
    assert explorer.micro_batch_size.value == best.micro_batch
    assert "Suggested and applied" in explorer.suggestion.value
    assert "| rank | schedule |" in explorer.suggestion.value
    assert ("modeled only" in explorer.suggestion.value) == best.modeled_only


def test_suggest_under_a_budget_nothing_fits_shows_the_smallest_that_does(explorer):
    before = explorer.config
    assert explorer.suggest(budget_mib=0.01, costs=[reference(8)]) is None
    assert explorer.suggested is None
    assert "smallest budget that fits is" in explorer.suggest_error
    assert "smallest budget that fits is" in explorer.suggestion.value
    assert explorer.config == before                           # nothing applied
    assert explorer.suggest(budget_mib="lots") is None
    assert "write MiB per IPU" in explorer.suggest_error
    explorer.memory_budget.value = ""
    explorer.suggest_button.click()                            # the button: no limit, machine's costs
    assert explorer.suggested is not None and explorer.suggest_error is None
    assert explorer.config.micro_batch_size == explorer.suggested.micro_batch


def test_suggest_gives_the_vit_its_layers_per_ipu(explorer):
    explorer.set(model="ViT", layers_per_ipu="2, 2, 2, 2", micro_batch_size=8,
                 gradient_accumulation=8, device_iterations=1)
    best = explorer.suggest(costs=[VIT.reference_costs(8), VIT.reference_costs(32)])
    assert best is not None, explorer.suggest_error
    assert all(any({"LayerNorm", "Classifier"} <= set(s) for s in p.stages)
               for p in best.alternatives)                      # parallelize keeps them together
    assert list(explorer.config.layers_per_ipu) == best.layers_per_ipu(VIT.layer_blocks)
    assert explorer.config.stage_blocks == best.stages and explorer.config.schedule == best.title
    assert explorer.last_error is None, explorer.last_error
