"""Measured memory per virtual IPU during the real call (ipukit.runtime.memory_track).

Laws on counts of bytes, never on times: what a call allocates is released by its
end; GPipe's stash grows with the micro-batches and 1F1B's does not; the tracks are
part of the timeline and of its Chrome trace; measured and modeled agree where both
are exactly computable.
"""
import json

import pytest
import torch
import torch.nn as nn

import ipukit
from ipukit.runtime.memory_track import coalesce, track_memory, tracking
from ipukit.timeline.events import MemoryTrack, Timeline
from ipukit.viz.memory import activation_bytes, measured_memory

WIDTH, CLASSES = 32, 4


class Stack(nn.Module):
    """``blocks`` Linear+tanh blocks (block i on IPU i), then a head with the loss."""

    def __init__(self, blocks: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks - 1))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            with ipukit.Block(f"B{i}"):
                x = torch.tanh(layer(x))
        with ipukit.Block(f"B{len(self.layers)}"):
            out = self.head(x)
            loss = nn.functional.cross_entropy(out, y)
        return out, loss


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, y):
        out = self.fc(x)
        return out, nn.functional.cross_entropy(out, y)


def pipelined(blocks=3, ga=5, schedule="1F1B", sharded=False, track=False):
    torch.manual_seed(0)
    net = Stack(blocks)
    opts = ipukit.Options().pipelineSchedule(schedule).trackMemory(track)
    cls = ipukit.ShardedExecution if sharded else ipukit.PipelinedExecution
    opts.setExecutionStrategy(cls(*[ipukit.Stage(f"B{i}").ipu(i) for i in range(blocks)]))
    opts.Training.gradientAccumulation(ga)
    return ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def tracked_call(model, x, y):
    model(x, y)                       # compile and warm up outside the tracker
    with track_memory():
        out = model(x, y)
    return model.getTimeline(), out


def test_off_unless_asked():
    assert not tracking()
    model = pipelined(ga=5)
    model(*batch(5 * 8))
    assert model.getTimeline().memory == []
    with track_memory():
        assert tracking()
        with track_memory(False):
            assert tracking()         # an inner "off" does not undo an outer "on"
    assert not tracking()


def test_one_stage_peak_holds_weights_and_gradients_and_everything_is_released():
    torch.manual_seed(0)
    net = OneLinear()
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(4)
    model = ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))
    mb = 16
    tl, _ = tracked_call(model, *batch(4 * mb))
    [track] = tl.memory
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    assert track.ipu == 0 and track.parts["parameters"] == params
    assert track.baseline == params                      # SGD without momentum: no state
    assert track.peak >= 2 * params                      # weights and their gradients at once
    # everything the call allocated is released by its end, but the output rows it returns
    # (OutputMode.Final: the last micro-batch's logits and loss)
    assert 0 <= track.end - track.baseline <= mb * CLASSES * 4 + 4
    assert track.samples[0][1] == track.baseline and track.samples[-1][1] == track.end
    assert max(b for _, b in track.samples) == track.peak


def _stash_count(schedule, ga):
    model = pipelined(ga=ga, schedule=schedule)
    mb = 64
    tl, _ = tracked_call(model, *batch(ga * mb))
    per_mb = activation_bytes(model)[0]
    track = tl.memory_track(0)
    return (track.peak - track.baseline) / per_mb


def test_gpipe_stash_grows_with_micro_batches_1f1b_stays_bounded():
    g5, g13 = _stash_count("GPipe", 5), _stash_count("GPipe", 13)
    f5, f13 = _stash_count("1F1B", 5), _stash_count("1F1B", 13)
    assert g13 - g5 >= 7          # 8 more micro-batches held at GPipe's peak on stage 0
    # 1F1B's stage 0 holds N − 0 = 3 either way (plus its pass's own temporaries, and at most
    # a hand-off the next stage has not dropped yet: a storage counts until it is freed)
    assert f13 < 3 + 2 and abs(f13 - f5) < 1.5
    assert f13 < g13 - 6


def test_tracks_are_in_the_timeline_and_the_chrome_trace(tmp_path):
    model = pipelined(ga=5)
    tl, _ = tracked_call(model, *batch(5 * 8))
    assert [(m.replica, m.ipu) for m in tl.memory] == [(0, 0), (0, 1), (0, 2)]
    assert set(tl.memory_peaks()) == {0, 1, 2}
    for m in tl.memory:
        assert m.peak >= m.baseline > 0 and len(m.samples) >= 2
        assert all(t1 <= t2 for (t1, _), (t2, _) in zip(m.samples, m.samples[1:]))
    trace = tl.to_chrome_trace(str(tmp_path / "t.json"))
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"memory IPU 0", "memory IPU 1", "memory IPU 2"}
    peak0 = max(e["args"]["MiB"] for e in counters if e["name"] == "memory IPU 0")
    assert peak0 == pytest.approx(tl.memory_track(0).peak / 2 ** 20, abs=1e-6)
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"] == trace["traceEvents"]
    # shifting and joining calls keeps the tracks
    both = Timeline.concat([tl, tl])
    assert len(both.memory) == 3 and both.memory_peaks() == tl.memory_peaks()
    assert len(both.memory[0].samples) == 2 * len(tl.memory[0].samples)
    assert tl.shifted(1.0).memory[0].peak_time == pytest.approx(tl.memory[0].peak_time + 1.0)


def test_profile_writes_measured_beside_modeled(tmp_path):
    pytest.importorskip("plotly")
    model = pipelined(ga=5)
    x, y = batch(5 * 8)
    model(x, y)
    from ipukit.viz.plots import memory_timeline_figure
    from ipukit.viz.profile import write_profile

    with track_memory():
        model(x, y)
    paths = write_profile(model.getTimeline(), str(tmp_path), model)
    data = json.loads(open(paths["memory"]).read())
    assert "stages" in data and len(data["measured"]) == 3
    assert [r["ipu"] for r in data["measured_vs_modeled"]] == [0, 1, 2]
    assert "memory IPU 0" in open(paths["trace"]).read()
    fig = memory_timeline_figure(model.getTimeline())
    assert any(getattr(t, "name", "") == "IPU 0 memory" for t in fig.data)


def test_measured_matches_modeled_where_activations_dominate():
    """Two stages, wide activations, narrow weights: GPipe holds M micro-batches, as modeled."""
    model = pipelined(blocks=2, ga=8, schedule="GPipe")
    tl, _ = tracked_call(model, *batch(8 * 256))
    report = measured_memory(model, tl)
    for row in report.rows:
        # the measurement adds the pass's own temporaries (a backward's gradients) on top
        assert 0.95 <= row["ratio"] <= 1.35, row
        assert row["modeled_ipu_bytes"] == row["modeled_bytes"]   # one stage per IPU
    assert "measured" in repr(report)


def test_measured_report_needs_a_tracked_call():
    model = pipelined(ga=5)
    model(*batch(5 * 8))
    with pytest.raises(ipukit.Error):
        measured_memory(model)


def test_sharded_call_on_one_thread_counts_every_ipu_on_one_track():
    model = pipelined(ga=2, sharded=True)
    tl, _ = tracked_call(model, *batch(2 * 8))
    [track] = tl.memory
    params = sum(p.numel() * p.element_size() for p in model.model.parameters())
    assert track.ipu == -1 and track.name == "all IPUs"
    assert track.parts["parameters"] == params and track.peak >= 2 * params


def test_coalesce_keeps_the_peak_and_the_ends():
    samples = [(i * 1e-6, (i * 7919) % 1000) for i in range(10_000)]
    peak = max(samples, key=lambda s: s[1])
    out = coalesce(samples, keep=peak[0], resolution=1e-4)
    assert len(out) < len(samples) // 10
    assert out[0] == samples[0] and out[-1] == samples[-1]
    assert peak in out and max(b for _, b in out) == peak[1]
    assert MemoryTrack(0, samples=out).shifted(1.0).samples[0][0] == pytest.approx(1.0)


def test_tracking_changes_no_result():
    """The same call with and without the tracker: the same losses and the same weights."""
    x, y = batch(5 * 8)
    runs = []
    for track in (False, True):
        model = pipelined(ga=5, schedule="ZBH1")
        with track_memory(track):
            _, loss = model(x, y)
        runs.append((loss, [p.detach().clone() for p in model.model.parameters()]))
        model.destroy()
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


class Deep(nn.Module):
    """Two stages; the first keeps three activations inside (what recomputation drops)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH),
                                                                   nn.Tanh())))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, y):
        with ipukit.Block("B0"):
            x = self.body(x)
        with ipukit.Block("B1"):
            out = self.head(x)
            loss = nn.functional.cross_entropy(out, y)
        return out, loss


def test_recomputation_is_measured_and_modeled_per_ipu():
    """GPipe with the first stage recomputing: its stash holds its inputs and outputs only."""
    def run(recompute):
        torch.manual_seed(0)
        net = Deep()
        if recompute:
            ipukit.recomputation_checkpoint(net.body)
        opts = ipukit.Options().pipelineSchedule("GPipe")
        opts.setExecutionStrategy(ipukit.PipelinedExecution(ipukit.Stage("B0").ipu(0),
                                                            ipukit.Stage("B1").ipu(1)))
        opts.Training.gradientAccumulation(8)
        model = ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))
        tl, _ = tracked_call(model, *batch(8 * 256))
        return measured_memory(model, tl)

    plain, recomputed = run(False), run(True)
    p0, r0 = plain.rows[0], recomputed.rows[0]
    assert r0["measured_peak_bytes"] < p0["measured_peak_bytes"]       # recomputation saves
    assert r0["modeled_bytes"] == p0["modeled_bytes"]                  # memory_report ignores it
    assert r0["modeled_ipu_bytes"] < p0["modeled_ipu_bytes"]           # the IPU model does not
    for row in plain.rows + recomputed.rows:
        assert 0.9 <= row["measured_peak_bytes"] / row["modeled_ipu_bytes"] <= 1.4, row
    assert any("recomput" in n for n in recomputed.notes)


def test_every_replica_has_its_own_tracks(monkeypatch):
    torch.manual_seed(0)
    net = Stack(2)
    opts = ipukit.Options().replicationFactor(2)
    opts.setExecutionStrategy(ipukit.PipelinedExecution(ipukit.Stage("B0").ipu(0),
                                                        ipukit.Stage("B1").ipu(1)))
    opts.Training.gradientAccumulation(4)
    model = ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01,
                                                            momentum=0.9))
    x, y = batch(2 * 4 * 16)
    model(x, y)                                  # the momentum buffers exist after it
    monkeypatch.setenv("IPUKIT_TRACK_MEMORY", "1")
    model(x, y)
    tl = model.getTimeline()
    assert [(m.replica, m.ipu) for m in tl.memory] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for ipu in (0, 1):
        r0, r1 = tl.memory_track(ipu, 0), tl.memory_track(ipu, 1)
        # each replica holds the weights and the optimiser state (shared here, one per IPU there)
        assert r0.baseline == r1.baseline == 2 * r0.parts["parameters"] > 0
    trace = tl.to_chrome_trace()
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "C"} == {0, 1}


def test_benchmark_table_renders(tmp_path):
    from benchmarks.memory import markdown

    row = {"model": "m", "schedule": "GPipe", "recompute": False, "ipu": 0, "in_flight": [8],
           "measured": 2 ** 20, "baseline": 0, "held": 2 ** 20, "modeled": 2 ** 20,
           "modeled_static": 0, "modeled_stash": 2 ** 20, "modeled_ipu": 2 ** 20,
           "modeled_held": 2 ** 20, "ratio": 1.0, "calibrated": 2 ** 20,
           "calibrated_held": 2 ** 20, "transient": 0}
    cost = {"model": "m", "schedule": "1F1B", "calls": 1, "plain_s": 0.1, "tracked_s": 0.2,
            "ratio": 2.0}
    text = markdown([row], [cost])
    assert "| m | GPipe | no | 0 | [8] | 1.000 |" in text and "1.00 ✓" in text
    assert "Where and why they differ" in text and "| 2.00 |" in text


# -- Options.trackMemory; the memory benchmark's pass transients measured on each stage alone --

def test_track_memory_option_measures_every_call_without_the_context_manager():
    from ipukit.core.errors import FrozenOptionsError

    assert ipukit.track_memory is track_memory            # exported at the top level
    opts = ipukit.Options()
    assert opts.track_memory is False and opts.toDict()["ipukit"]["track_memory"] is False
    assert "track_memory=True" in repr(ipukit.Options().trackMemory(True))
    with pytest.raises(ipukit.OptionsError):
        ipukit.Options().trackMemory("yes")
    model = pipelined(ga=5, track=True)
    assert model.options.toDict()["ipukit"]["track_memory"] is True
    x, y = batch(5 * 8)
    for _ in range(2):                                    # every call, not only the first
        model(x, y)
        assert not tracking()                             # the switch is the model's alone
        assert {m.ipu for m in model.getTimeline().memory} == {0, 1, 2}
    with pytest.raises(FrozenOptionsError):
        model.options.trackMemory(False)
    other = pipelined(ga=5)                               # other models stay untracked
    other(x, y)
    assert other.getTimeline().memory == []


def _one_linear(ga=4, track=True):
    torch.manual_seed(0)
    net = OneLinear()
    opts = ipukit.Options().trackMemory(track)
    opts.Training.gradientAccumulation(ga)
    return ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))


def test_one_stage_peak_is_static_plus_stash_plus_the_largest_pass_transient():
    """One stage on one thread: the memory benchmark's calibrated model and the measurement
    count the same tensors, so they agree to a few bytes; without the transient the model
    stays below."""
    from benchmarks.memory_transients import calibrated_columns

    model = _one_linear()
    x, y = batch(4 * 16)
    model(x, y)
    model(x, y)
    measured = measured_memory(model)
    [row] = measured.rows
    cal = calibrated_columns(model, measured)[row["ipu"]]
    assert cal["transient"] > 0
    assert abs(row["measured_peak_bytes"] - cal["calibrated"]) <= 64
    assert abs(row["measured_held_bytes"] - cal["calibrated_held"]) <= 64
    assert row["modeled_ipu_bytes"] < row["measured_peak_bytes"]


def test_gpipe_peaks_are_predicted_from_isolated_passes():
    """GPipe peaks at each stage's first backward, all M micro-batches stashed and no
    gradient sent yet: what each IPU holds then depends on its own lane only, so the
    benchmark's model calibrated on isolated passes predicts every IPU's peak to a few
    bytes. (1F1B's later stages also hold the gradients they sent until the receiver drops
    them: timing.)"""
    from benchmarks.memory_transients import calibrated_columns

    model = pipelined(ga=5, schedule="GPipe")
    x, y = batch(5 * 64)
    tracked_call(model, x, y)
    measured = measured_memory(model)
    cal = calibrated_columns(model, measured)
    for r in measured.rows:
        assert abs(r["measured_peak_bytes"] - cal[r["ipu"]]["calibrated"]) <= 64
        assert cal[r["ipu"]]["calibrated"] > r["modeled_ipu_bytes"]   # the transient adds


def test_stage_transients_measure_stages_alone_and_change_nothing():
    from benchmarks.memory_transients import stage_transients

    model = pipelined(ga=5, schedule="ZBH1")
    x, y = batch(5 * 16)
    model(x, y)                                           # compiled, untracked
    before = [t.detach().clone() for t in model.model.state_dict().values()]
    rng = torch.get_rng_state()
    found = stage_transients(model.program)               # synthetic micro-batch, no call
    after = list(model.model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(rng, torch.get_rng_state())
    assert len(found) == 3
    keys = {"held", "forward", "backward", "input_grad", "between", "weight_grad", "sent"}
    for t in found:
        assert keys <= set(t) and t["held"] > 0
        assert t["backward"] >= 0 and t["input_grad"] >= 0 and t["weight_grad"] >= 0
    assert found[0]["sent"] == 0 and found[1]["sent"] > 0   # IPU 0's inputs need no gradient
    assert found[1]["between"] > 0      # I keeps captured gradients for W
    assert found == stage_transients(model.program)       # counts, not times: repeatable
