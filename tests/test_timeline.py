"""Measured timelines: what a real pipelined call recorded, and the exports built on it.

The model sleeps a known time per block (forward and backward, releasing the
GIL), so durations and dependencies can be checked on a busy 2-core machine.
"""
import json
import random
import statistics
from collections import defaultdict

import jsonschema
import pytest
import torch
import torch.nn as nn

import ipukit
from ipukit import Event, Timeline
from helpers import sleep_ms

MS = (6.0, 3.0, 9.0, 3.0)   # sleep per block: unequal on purpose


class SleepStack(nn.Module):
    """One block per entry of ``ms``: Linear, then a sleep of ``ms[i]`` ms; loss in the last."""

    def __init__(self, ms=MS, width: int = 8):
        super().__init__()
        self.ms = tuple(ms)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in self.ms)

    def forward(self, x, y):
        for i, (layer, ms) in enumerate(zip(self.layers, self.ms)):
            with ipukit.Block(f"B{i}"):
                x = sleep_ms(torch.tanh(layer(x)), ms)
                if i == len(self.layers) - 1:
                    loss = nn.functional.mse_loss(x, y)
        return x, loss


def pipelined(num_blocks: int, **options):
    """Options with one Stage per block, each on its own IPU."""
    opts = ipukit.Options()
    opts.setExecutionStrategy(ipukit.PipelinedExecution(
        *[ipukit.Stage(f"B{i}").ipu(i) for i in range(num_blocks)]))
    for name, value in options.items():
        if name == "gradientAccumulation":
            opts.Training.gradientAccumulation(value)
        else:
            getattr(opts, name)(value)
    return opts


def run_training(ms=MS, ga=7, di=2, replicas=1, schedule="1F1B", batch=2):
    net = SleepStack(ms)
    opts = pipelined(len(ms), gradientAccumulation=ga, deviceIterations=di,
                     replicationFactor=replicas, pipelineSchedule=schedule)
    model = ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))
    n = batch * ga * di * replicas
    x, y = torch.randn(n, 8), torch.randn(n, 8)
    model(x, y)      # compiles
    model(x, y)
    return model, model.getTimeline()


@pytest.fixture(scope="module")
def measured():
    return run_training()


def _by(events):
    return {(e.replica, e.stage, e.kind, e.iteration, e.micro_batch): e for e in events}


# -- the measured events ---------------------------------------------------------------------

def test_events_never_overlap_on_a_track(measured):
    _, tl = measured
    tracks = defaultdict(list)
    for e in tl.device_events():
        tracks[(e.replica, e.ipu)].append(e)
    assert len(tracks) == 4
    for events in tracks.values():
        events.sort(key=lambda e: e.start)
        for a, b in zip(events, events[1:]):
            if a.kind == b.kind == "step":
                continue
            assert b.start >= a.end, (a, b)


def test_every_action_of_the_schedule_ran_exactly_once(measured):
    model, tl = measured
    actions = [(e.stage, e.kind, e.micro_batch, e.iteration) for e in tl.device_events()]
    assert len(actions) == len(set(actions))
    assert len(actions) == 4 * (2 * 7 + 1) * 2


def test_durations_are_real_and_vary(measured):
    _, tl = measured
    for s, ms in enumerate(MS):
        for kind in ("forward", "backward"):
            d = [e.duration for e in tl.events if e.stage == s and e.kind == kind]
            assert len(d) == 14
            assert min(d) >= ms / 1000 * 0.95, (s, kind, min(d))
            assert statistics.pstdev(d) > 0
    # stage 0 never waits for another stage's forward: its median is the sleep, plus a little
    assert MS[0] / 1000 <= tl.stage_costs()["forward"][0] < MS[0] / 1000 + 0.02
    steps = [e for e in tl.events if e.kind == "step"]
    assert len(steps) == 4 * 2 and all(e.duration > 0 for e in steps)


def test_micro_batches_flow_forward_then_back_in_order(measured):
    """Finishing order: forward on s+1 ends after forward on s; backward runs in reverse."""
    _, tl = measured
    ev = _by(tl.device_events())
    for (r, s, kind, it, m), e in ev.items():
        if kind == "forward" and s > 0:
            assert e.end > ev[(r, s - 1, "forward", it, m)].end
        if kind == "backward" and s < 3:
            assert e.end > ev[(r, s + 1, "backward", it, m)].end
        if kind == "backward" and s == 3:
            assert e.start >= ev[(r, s, "forward", it, m)].end
        if kind == "step":
            last = max(x.end for x in tl.device_events()
                       if x.iteration == it and x.kind != "step")
            assert e.start >= last


def test_measured_spans_start_after_their_inputs_exist(measured):
    """A forward on stage s+1 starts after it ends on stage s; backwards in reverse order.

    Spans cover the work only: waiting for another stage is idle time (a bubble).
    """
    _, tl = measured
    ev = _by(tl.device_events())
    for (r, s, kind, it, m), e in ev.items():
        if kind == "forward" and s > 0:
            assert e.start >= ev[(r, s - 1, "forward", it, m)].end, e
        if kind == "backward" and s < 3:
            assert e.start >= ev[(r, s + 1, "backward", it, m)].end, e
    # so a stage that sleeps 3 ms shows 3 ms spans, though it waits for a 9 ms stage
    assert statistics.median(e.duration for e in ev.values()
                             if e.stage == 3 and e.kind == "forward") < MS[2] / 1000


def test_the_same_schedule_drives_executor_and_model(measured):
    model, tl = measured
    modeled = ipukit.simulate(model.program.schedule.kind, 4, 7, iterations=2,
                              schedule=model.program.schedule)
    key = lambda e: (e.stage, e.kind, e.micro_batch, e.iteration)  # noqa: E731
    assert {key(e) for e in tl.device_events()} == {key(e) for e in modeled.events}
    # and each virtual IPU ran its lane in the schedule's order
    for lane, ipu in zip(model.program.schedule.lanes, model.program.schedule.lane_ipus):
        ran = sorted((e for e in tl.device_events() if e.ipu == ipu), key=lambda e: e.start)
        kinds = {"F": "forward", "B": "backward", "S": "step"}
        assert [(e.kind, e.stage, e.micro_batch, e.iteration) for e in ran] == \
            [(kinds[a.kind], a.stage, a.micro_batch, a.iteration) for a in lane]


def test_gpipe_and_replicas_have_their_own_tracks():
    model, tl = run_training(ms=(2.0, 2.0), ga=3, di=1, replicas=2, schedule="GPipe")
    assert tl.tracks() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    names = {e.track for e in tl.device_events()}
    assert names == {"IPU 0", "IPU 1", "IPU 0 · replica 1", "IPU 1 · replica 1"}
    for r in (0, 1):   # GPipe: every forward of the window before the first backward
        for s in (0, 1):
            ev = [e for e in tl.device_events() if (e.replica, e.stage) == (r, s)
                  and e.kind != "step"]
            last_f = max(e.end for e in ev if e.kind == "forward")
            assert all(e.start >= last_f for e in ev if e.kind == "backward")
    assert set(tl.utilisation()["per_track"]) == names


# -- metrics on hand-made timelines ----------------------------------------------------------

def _handmade():
    return Timeline([
        Event(-1, "host", -1, 0.0, 1.0, -1),
        Event(0, "forward", 0, 1.0, 3.0, 0), Event(0, "backward", 0, 6.0, 8.0, 0),
        Event(1, "forward", 0, 3.0, 4.0, 1), Event(1, "backward", 0, 4.0, 6.0, 1),
        Event(0, "step", -1, 8.0, 9.0, 0), Event(1, "step", -1, 8.0, 9.0, 1),
    ], meta={"samples": 18, "kind": "gpipe", "num_stages": 2, "micro_batches": 1})


def test_utilisation_throughput_and_costs_by_hand():
    tl = _handmade()
    assert tl.wall_time == 9.0
    u = tl.utilisation()
    # busy = forwards and backwards; the step (8-9) runs on the host, every IPU waits
    assert u["per_ipu"] == {0: 4 / 9, 1: 3 / 9}
    assert u["overall"] == pytest.approx(7 / 18) and u["bubble"] == pytest.approx(11 / 18)
    assert tl.throughput() == pytest.approx(2.0)
    assert tl.time_per_step() == 9.0 and tl.speed()["samples_per_second"] == pytest.approx(2.0)
    assert tl.host_steps() == [Event(-1, "step", -1, 8.0, 9.0, -1)]
    assert tl.stage_costs() == {"forward": [2.0, 1.0], "backward": [2.0, 2.0], "step": [1.0, 1.0]}
    assert ipukit.costs_from(tl)["forward_cost"] == [2.0, 1.0]


def test_concat_and_shifted_keep_durations():
    tl = _handmade()
    both = Timeline.concat([tl, tl.shifted(100.0)])
    assert both.wall_time == pytest.approx(18.0)
    assert sorted(e.duration for e in both.events) == sorted(2 * [e.duration for e in tl.events])
    assert {e.call for e in both.events} == {0, 1}


# -- the Chrome trace ------------------------------------------------------------------------

TRACE_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {
            "type": "array", "minItems": 1,
            "items": {
                "type": "object",
                "required": ["ph", "name", "pid", "tid"],
                "properties": {
                    "ph": {"enum": ["X", "M"]},
                    "name": {"type": "string"},
                    "pid": {"type": "integer", "minimum": 0},
                    "tid": {"type": "integer", "minimum": 0},
                    "ts": {"type": "number", "minimum": 0},
                    "dur": {"type": "number", "minimum": 0},
                    "args": {"type": "object"},
                },
                "if": {"properties": {"ph": {"const": "X"}}},
                "then": {"required": ["ts", "dur", "cat"]},
                "else": {"required": ["args"]},
            },
        },
    },
}


def test_chrome_trace_is_valid_with_one_track_per_virtual_ipu(measured, tmp_path):
    _, tl = measured
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    jsonschema.validate(trace, TRACE_SCHEMA)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(tl.events)
    device = [e for e in spans if e["args"]["stage"] >= 0]
    assert len({(e["pid"], e["tid"]) for e in device}) == len(tl.tracks()) == 4
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {names[(e["pid"], e["tid"])] for e in device} == {f"IPU {i}" for i in range(4)}
    one = max(tl.device_events(), key=lambda e: e.duration)
    match = [e for e in device if e["args"]["stage"] == one.stage and e["cat"] == one.kind
             and e["args"]["micro_batch"] == one.micro_batch
             and e["args"]["iteration"] == one.iteration]
    assert len(match) == 1 and match[0]["dur"] == pytest.approx(one.duration * 1e6, abs=0.01)


# -- where the idle time goes ------------------------------------------------------------------

def test_idle_breakdown_by_hand():
    """host 0-1 and step 8-9 leave both IPUs idle; in 1-8 the pipeline of 2 stages, 1
    micro-batch: textbook (N-1)/(M+N-1) = 1/2 of its 2 x 7 IPU-seconds is the bubble
    (7 of 14; busy 7), so nothing is left for imbalance."""
    b = _handmade().idle_breakdown()
    assert b["capacity"] == 18.0 and b["busy"] == 7.0 and b["idle"] == 11.0
    assert b["host"] == 2.0 and b["step"] == 2.0
    assert b["textbook_bubble"] == 0.5 and b["bubble"] == 7.0 and b["imbalance"] == 0.0
    assert sum(b["shares"].values()) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("N,M", [(2, 2), (4, 4), (4, 8), (3, 10), (6, 7)])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_textbook_bubble_matches_the_unit_cost_grid(kind, N, M, backward):
    """Equal stages: the grid has M + N - 1 slots per phase, each row M busy ones."""
    tl = ipukit.simulate(kind, N, M, forward_cost=1.0, backward_cost=backward)
    assert tl.wall_time == pytest.approx((M + N - 1) * (1.0 + backward))
    b = tl.idle_breakdown()
    assert b["textbook_bubble"] == pytest.approx((N - 1) / (M + N - 1))
    assert b["shares"]["bubble"] == pytest.approx((N - 1) / (M + N - 1))
    assert b["imbalance"] == pytest.approx(0.0, abs=1e-9)
    assert b["host"] == b["step"] == 0.0
    assert b["shares"]["bubble"] == pytest.approx(tl.utilisation()["bubble"])


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "sharded", "inference"])
def test_idle_parts_add_up_to_the_idle_time(kind):
    rng = random.Random(kind)
    N, M, D = 4, 6, 3
    tl = ipukit.simulate(kind, N, M, forward_cost=[rng.uniform(0.5, 2) for _ in range(N)],
                         backward_cost=[rng.uniform(1, 4) for _ in range(N)] if "inf" not in kind
                         else 0.0, step_cost=0.7, host_overhead=2.5, iterations=D)
    b = tl.idle_breakdown()
    assert b["idle"] == pytest.approx(b["capacity"] * (1 - tl.utilisation()["overall"]))
    assert b["bubble"] + b["imbalance"] + b["host"] + b["step"] == pytest.approx(b["idle"])
    assert b["host"] == pytest.approx(N * 2.5)                     # every IPU waits for the host
    if kind != "inference":                                        # and for every step
        assert len(tl.host_steps()) == D
        assert b["step"] == pytest.approx(N * sum(e.duration for e in tl.host_steps()))
        if kind != "sharded":       # (a sharded lane steps its stages one after another)
            assert b["step"] == pytest.approx(N * 0.7 * D)
    if kind != "inference":
        assert b["imbalance"] > 0                                  # unequal stages
    if kind == "sharded":
        assert b["textbook_bubble"] == pytest.approx((N - 1) / N)


def test_a_slow_stage_is_imbalance_not_bubble():
    even = ipukit.simulate("1f1b", 4, 16, forward_cost=1.0, backward_cost=2.0).idle_breakdown()
    slow = ipukit.simulate("1f1b", 4, 16, forward_cost=[1, 3, 1, 1],
                           backward_cost=[2, 6, 2, 2]).idle_breakdown()
    assert slow["shares"]["bubble"] == pytest.approx(even["shares"]["bubble"])
    assert slow["shares"]["imbalance"] > 0.3 and even["shares"]["imbalance"] == pytest.approx(0)


def test_more_micro_batches_shrink_the_bubble_not_host_or_imbalance_time():
    shares = [ipukit.simulate("1f1b", 4, m, forward_cost=[1, 2, 1, 1], backward_cost=2.0,
                              host_overhead=5.0).idle_breakdown() for m in (4, 8, 32)]
    bubbles = [b["shares"]["bubble"] for b in shares]
    assert bubbles == sorted(bubbles, reverse=True)
    assert [b["textbook_bubble"] for b in shares] == pytest.approx([3 / 7, 3 / 11, 3 / 35])


def test_peak_activations_in_flight():
    N, M = 4, 8
    assert ipukit.simulate("gpipe", N, M).peak_in_flight() == {s: M for s in range(N)}
    assert ipukit.simulate("1f1b", N, M).peak_in_flight() == {s: N - s for s in range(N)}
    assert ipukit.simulate("inference", N, M).peak_in_flight() == {s: 1 for s in range(N)}


def test_measured_steps_are_not_busy_time(measured):
    _, tl = measured
    steps = [e for e in tl.events if e.kind == "step"]
    assert steps, "a training call records its optimiser steps"
    busy = tl.busy_time()
    passes = {}
    for e in tl.device_events():
        if e.kind in ("forward", "backward"):
            passes[(e.replica, e.ipu)] = passes.get((e.replica, e.ipu), 0.0) + e.duration
    assert busy == pytest.approx(passes)
    b = tl.idle_breakdown()
    assert b["bubble"] + b["imbalance"] + b["host"] + b["step"] == pytest.approx(b["idle"])
    assert b["step"] >= 0.99 * len(tl.tracks()) * sum(e.duration for e in tl.host_steps())


# -- measuring on a CPU whose cores the workers share ------------------------------------------

def test_uncontended_costs_undo_fair_sharing():
    """The benchmarks' replay of a contended run: 4 passes of 1 s each started together on
    2 cores: each span lasts 2 s, each did 1 s."""
    from benchmarks.common import uncontended_costs

    events = [Event(s, "forward", 0, 0.0, 2.0, s) for s in range(4)]
    events += [Event(s, "backward", 0, 2.0 + s, 3.0 + s, s) for s in range(4)]   # one at a time
    tl = Timeline(events, meta={"kind": "gpipe", "num_stages": 4, "micro_batches": 1})
    assert tl.stage_costs()["forward"] == [2.0] * 4
    c = uncontended_costs(tl, cores=2)
    assert c["forward"] == pytest.approx([1.0] * 4)
    assert c["backward"] == pytest.approx([1.0] * 4)
    assert uncontended_costs(tl, cores=4)["forward"] == pytest.approx([2.0] * 4)   # no sharing
    with pytest.raises(ValueError):
        uncontended_costs(tl, cores=0)


def test_available_cores_is_the_executors_count():
    import os

    from ipukit.runtime.executor import default_threads
    from ipukit.timeline.simulate import available_cores

    assert available_cores() == len(os.sched_getaffinity(0)) == default_threads(1)


def test_concat_keeps_every_calls_meta_and_the_totals():
    """Three calls joined: samples add up, so throughput and time per call are the calls'."""
    calls = []
    for k in range(3):
        events = [Event(0, "forward", 0, 0.0, 0.010, 0, 0, 0, k),
                  Event(1, "forward", 0, 0.010, 0.020, 1, 0, 0, k)]
        calls.append(Timeline(events, meta={"samples": 40, "call": k, "iterations": 1}))
    joined = Timeline.concat(calls)
    assert joined.calls == 3
    assert joined.meta["samples"] == 120
    assert [m["call"] for m in joined.meta["per_call"]] == [0, 1, 2]
    assert joined.wall_time == pytest.approx(0.060)
    assert joined.time_per_call() == pytest.approx(0.020)
    assert joined.throughput() == pytest.approx(120 / 0.060)
    assert joined.throughput() == pytest.approx(calls[0].throughput())
    assert joined.time_per_step() == pytest.approx(0.020)
