"""The schedule model: textbook utilisation, dependencies, core limits, modeling measured runs."""
import random
from collections import defaultdict

import pytest

import ipukit
from ipukit import Timeline
from ipukit.schedules import build
from ipukit.schedules.ir import walk

KINDS = ("gpipe", "1f1b", "sharded", "inference", "sharded-inference")
CASES = [(1, 1), (2, 3), (2, 8), (3, 5), (4, 4), (4, 16), (6, 2), (8, 32)]


def check_respects_schedule(tl: Timeline, cores=None):
    """No overlap on a track; forward s+1 after s; backward s after s+1; step after flush."""
    tracks = defaultdict(list)
    for e in tl.device_events():
        tracks[(e.replica, e.ipu)].append(e)
    for events in tracks.values():
        events.sort(key=lambda e: (e.start, e.end))
        for a, b in zip(events, events[1:]):
            assert b.start >= a.end - 1e-12, (a, b)
    ev = {(e.replica, e.stage, e.kind, e.iteration, e.micro_batch): e for e in tl.device_events()}
    last = max(e.stage for e in tl.device_events())
    for (r, s, kind, it, m), e in ev.items():
        if kind == "forward" and s > 0:
            assert e.start >= ev[(r, s - 1, "forward", it, m)].end - 1e-12
        elif kind == "backward":
            before = (r, s + 1, "backward", it, m) if s < last else (r, s, "forward", it, m)
            assert e.start >= ev[before].end - 1e-12
        elif kind == "step":
            flush = max(x.end for x in tl.device_events() if x.iteration == it and x.kind != "step")
            assert e.start >= flush - 1e-12
    if cores is not None:   # never more than `cores` forwards/backwards at one instant
        spans = [(e.start, e.end) for e in tl.device_events()
                 if e.kind != "step" and e.end > e.start]
        points = sorted([(s, 1) for s, _ in spans] + [(t, -1) for _, t in spans],
                        key=lambda p: (p[0], p[1]))
        running = 0
        for _, step in points:
            running += step
            assert running <= cores


# -- textbook numbers ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "inference"])
@pytest.mark.parametrize("N,M", CASES)
def test_pipelines_reach_m_over_m_plus_n_minus_1(kind, N, M):
    for fwd, bwd in ((1.0, 2.0), (0.3, 0.3)):
        tl = ipukit.simulate(kind, N, M, forward_cost=fwd, backward_cost=bwd)
        assert tl.utilisation()["overall"] == pytest.approx(M / (M + N - 1), rel=1e-12)
        for u in tl.utilisation()["per_ipu"].values():
            assert u == pytest.approx(M / (M + N - 1), rel=1e-12)


@pytest.mark.parametrize("kind", ["sharded", "sharded-inference"])
@pytest.mark.parametrize("N,M", CASES)
def test_sharded_reaches_one_over_n(kind, N, M):
    tl = ipukit.simulate(kind, N, M, forward_cost=1.0, backward_cost=2.0)
    assert tl.utilisation()["overall"] == pytest.approx(1 / N, rel=1e-12)


def test_overheads_and_slow_stage_lower_utilisation():
    base = ipukit.simulate("1f1b", 4, 8).utilisation()["overall"]
    assert ipukit.simulate("1f1b", 4, 8, host_overhead=2.0).utilisation()["overall"] < base
    assert ipukit.simulate("1f1b", 4, 8, transfer_cost=0.5).utilisation()["overall"] < base
    slow = ipukit.simulate("1f1b", 4, 8, forward_cost=[1, 1, 3, 1], backward_cost=[2, 2, 6, 2])
    # the slow stage paces the pipeline: at least M × its cost, and it is the busiest IPU
    assert slow.wall_time >= 8 * (3 + 6)
    per_ipu = slow.utilisation()["per_ipu"]
    assert max(per_ipu, key=per_ipu.get) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_modeled_timelines_respect_the_schedule(kind):
    rng = random.Random(kind)
    N, M = 4, 6
    tl = ipukit.simulate(kind, N, M, forward_cost=[rng.uniform(0.5, 2) for _ in range(N)],
                         backward_cost=[rng.uniform(0.5, 3) for _ in range(N)],
                         step_cost=0.4, transfer_cost=0.1, iterations=2, replicas=2)
    check_respects_schedule(tl)
    assert len(tl.device_events()) == 2 * len(build(kind, N, M, 2).actions())


# -- a CPU with few cores --------------------------------------------------------------------

def _random_case(rng, kind, N, M, iterations=2):
    costs = {"F": [rng.uniform(0.2, 2) for _ in range(N)],
             "B": [rng.uniform(0.2, 3) for _ in range(N)],
             "S": [rng.uniform(0, 0.5) for _ in range(N)]}
    transfers = {"F": [rng.uniform(0, 0.3) for _ in range(N)],
                 "B": [rng.uniform(0, 0.3) for _ in range(N)]}
    return build(kind, N, M, iterations), costs, transfers


@pytest.mark.parametrize("kind", KINDS)
def test_enough_cores_is_exactly_the_free_walk(kind):
    rng = random.Random(1)
    for N, M in ((1, 1), (2, 3), (4, 7), (3, 9)):
        schedule, costs, transfers = _random_case(rng, kind, N, M)
        expected = walk(schedule.lanes, N, costs, transfers, start_time=0.25)[0]
        got = walk(schedule.lanes, N, costs, transfers, start_time=0.25, cores=64, replicas=2)
        assert got[0] == expected and got[1] == expected


def test_stages_sharing_an_ipu_play_the_same_with_enough_cores():
    schedule = build("1f1b", 4, 8, 1, [0, 0, 1, 1])
    costs = {"F": [1.0, 0.5, 1.5, 1.0], "B": [2.0, 1.0, 3.0, 2.0]}
    assert walk(schedule.lanes, 4, costs, cores=2)[0] == walk(schedule.lanes, 4, costs)[0]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "inference"])
@pytest.mark.parametrize("cores", [1, 2, 3])
def test_a_core_limit_is_respected_and_costs_time(kind, cores):
    rng = random.Random(cores)
    schedule, costs, _ = _random_case(rng, kind, 4, 8)
    tl_free = ipukit.simulate(kind, 4, 8, costs["F"], costs["B"] if "inf" not in kind else 0.0,
                              step_cost=costs["S"], iterations=2, schedule=schedule)
    limited = ipukit.simulate(kind, 4, 8, costs["F"], costs["B"] if "inf" not in kind else 0.0,
                              step_cost=costs["S"], iterations=2, schedule=schedule, cores=cores)
    check_respects_schedule(limited, cores=cores)
    work = sum(e.duration for e in limited.device_events() if e.kind != "step")
    assert limited.wall_time >= work / cores - 1e-9
    assert limited.wall_time >= tl_free.wall_time - 1e-9


# -- cores shared at a calibrated rate; exposed and overlapped transfers -------------------

from ipukit.schedules.generators import placement  # noqa: E402
from ipukit.timeline.compare import compare_schedules  # noqa: E402
from ipukit.timeline.costs import CostTable  # noqa: E402
from ipukit.timeline.simulate import paired_actions  # noqa: E402

SPLIT_CASES = [("gpipe", 4, 4), ("1f1b", 3, 3), ("zb-h1", 4, 4), ("interleaved-1f1b", 4, 2),
               ("looped-bfs", 4, 2), ("zbv", 4, 2), ("dualpipev", 8, 4)]


def test_dualpipev_pairs_are_forwards_next_to_backwards_of_the_other_stage():
    sch = build("dualpipev", 4, 8, 1, placement("dualpipev", 4))
    pairs = paired_actions(sch.lanes)
    assert pairs
    for li, i in pairs:
        a = sch.lanes[li][i]
        assert a[0] in ("F", "B")


def test_dualpipev_hides_exposed_transfers_that_zbv_pays():
    def step(kind, t, mode="exposed"):
        return compare_schedules(4, 16, kinds=[kind], transfer_cost=t,
                                 communication=mode)[kind].step_time
    assert step("zbv", 0.0) == step("dualpipev", 0.0)
    assert step("dualpipev", 0.5) < step("zbv", 0.5)
    assert step("dualpipev", 0.5) - step("dualpipev", 0.0) < step("zbv", 0.5) - step("zbv", 0.0)
    assert step("zbv", 0.5, "latency") < step("zbv", 0.5)          # latency only: nobody busy
    with pytest.raises(ValueError):
        step("zbv", 0.5, "teleport")


def test_compare_with_a_table_cuts_the_real_blocks_on_the_same_ipus():
    t = CostTable(blocks=list("abcd"), forward=[1.8, 0.8, 0.2, 0.1],
                  backward=[0.5, 1.5, 0.25, 0.25], per_pass=0.0, handoff=0.0,
                  input_grad=[0.0, 1.0, 0.2, 0.1], weight_grad=[0.5, 0.9, 0.1, 0.2])
    two = compare_schedules(2, 8, table=t)
    assert {s.ipus for s in two.values()} == {2} and all(s.available for s in two.values())
    assert two["1f1b"].stage_blocks == [["a", "b"], ["c", "d"]]
    assert two["zbv"].stage_blocks == [["a"], ["b"], ["c"], ["d"]]
    assert two["zbv"].timeline.meta["stage_ipus"] == [0, 1, 1, 0]   # first and last on IPU 0
    for s in two.values():
        assert s.ipu_time == pytest.approx(2 * s.step_time)
        # each stage costs its own blocks, not half of its IPU's part
        busy = sum(e.duration for e in s.timeline.device_events())
        c = t.stage_costs(s.stage_blocks)
        split = sum(c["input-grad"]) + sum(c["weight-grad"])
        if s.kind in ("zbv", "zb-h1"):
            assert busy == pytest.approx(8 * (sum(t.forward) + split))
        elif s.kind != "dualpipev":       # (DualPipeV splits only some of its backwards)
            assert busy == pytest.approx(8 * (sum(t.forward) + sum(t.backward)))
    four = compare_schedules(4, 8, table=t)
    assert not four["zbv"].available and "4 blocks" in four["zbv"].reason
    assert four["1f1b"].available and four["1f1b"].ipus == 4
    # the first stage on its own (one IPU) has no input gradient to compute
    assert two["zbv"].timeline.meta["calibrated"]


@pytest.mark.parametrize("kind,N,P", SPLIT_CASES)
def test_the_walk_is_exactly_the_schedules_rules_with_a_core_per_worker(kind, N, P):
    """A random case, each action checked: it starts when its last dependency (or its
    lane's previous action) ended, plus the transfer it waits for."""
    rng = random.Random(N)
    ipus = placement(kind, N, P) if N != P else None
    sch = build(kind, N, 8, 2, ipus)
    costs = {k: [rng.uniform(0.5, 2) for _ in range(N)] for k in "FBIWS"}
    tr = {k: [rng.uniform(0, 0.3) for _ in range(N)] for k in "FB"}
    times = walk(sch.lanes, N, costs, tr, 0.1)[0]
    end = {}
    for lane, lt in zip(sch.lanes, times):
        for a, (t0, t1) in zip(lane, lt):
            assert t1 - t0 == pytest.approx(costs[a[0]][a[1]])
            end[tuple(a)] = t1
    for lane, lt in zip(sch.lanes, times):
        prev = 0.1
        for a, (t0, _) in zip(lane, lt):
            kind_, s, m, it = a
            deps = [prev]
            if kind_ == "F" and s > 0:
                deps.append(end[("F", s - 1, m, it)] + tr["F"][s])
            elif kind_ in "BI" and s < N - 1:
                g = end.get(("B", s + 1, m, it), end.get(("I", s + 1, m, it)))
                deps += [g + tr["B"][s], end[("F", s, m, it)]]
            elif kind_ == "W":
                deps.append(end[("I", s, m, it)])
            elif kind_ == "S":
                deps.append(max(e for k, e in end.items() if k[3] == it and k[0] != "S"))
            assert t0 == pytest.approx(max(deps))
            prev = end[tuple(a)]


def test_a_deadlocked_schedule_names_the_lanes_waiting_on_each_other():
    from ipukit.schedules.ir import Action, ScheduleError

    lanes = [[Action.from_str(a) for a in lane] for lane in (["0F0", "0B0"], ["1B0", "1F0"])]
    with pytest.raises(ScheduleError, match="lane 0 waits at 0B0 for 1B0 .lane 1., which waits at 1B0 for 1F0"):
        walk(lanes, 2, {"F": [1.0, 1.0], "B": [1.0, 1.0]})
