"""The schedule IR: torch.distributed.pipelining's action notation, round trips, validation."""
import pytest
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from ipukit.schedules import (Action, Schedule, ScheduleError, build, walk, BACKWARD, FORWARD,
                             STEP)

PIPELINED = [("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 3, 3), ("gpipe", 2, 5), ("1f1b", 5, 2)]


def test_action_string_is_stage_kind_micro_batch():
    assert str(Action(FORWARD, 2, 0)) == "2F0"
    assert str(Action(BACKWARD, 0, 13)) == "0B13"
    assert str(Action(STEP, 3)) == "3S"
    assert Action.from_str("2F0") == Action(FORWARD, 2, 0)
    assert Action.from_str("1W7", iteration=2) == Action("W", 1, 7, 2)
    assert Action.from_str("3S") == Action(STEP, 3, -1)


@pytest.mark.parametrize("text", ["F0", "0X1", "0F", "1S2", "", "a0F"])
def test_malformed_actions_are_rejected(text):
    with pytest.raises(ScheduleError, match="action"):
        Action.from_str(text)


@pytest.mark.parametrize("kind,n,m", PIPELINED)
def test_torch_parser_reads_ipukit_schedules(kind, n, m):
    schedule = build(kind, n, m)
    for lane, strings in zip(schedule.lanes, schedule.to_strings()):
        for a, text in zip(lane, strings):
            if a.kind == STEP:
                continue
            parsed = _Action.from_str(text)
            assert parsed.stage_index == a.stage
            assert parsed.microbatch_index == a.micro_batch
            assert parsed.computation_type == _ComputationType.from_str(a.kind)


@pytest.mark.parametrize("kind,n,m", PIPELINED + [("sharded", 3, 4), ("inference", 3, 4)])
@pytest.mark.parametrize("iterations", [1, 3])
def test_string_round_trip_is_exact(kind, n, m, iterations):
    schedule = build(kind, n, m, iterations)
    again = Schedule.from_strings(kind, schedule.to_strings(), n, m, schedule.stage_ipus,
                                  schedule.lane_ipus)
    assert again.lanes == schedule.lanes
    assert again.iterations == iterations


def test_round_trip_with_stages_sharing_ipus():
    schedule = build("1f1b", 4, 6, 2, stage_ipus=[0, 1, 0, 1])
    again = Schedule.from_strings("1f1b", schedule.to_strings(), 4, 6, [0, 1, 0, 1])
    assert again.lanes == schedule.lanes


@pytest.mark.parametrize("kind,n,m", PIPELINED)
def test_torch_action_lists_round_trip(kind, n, m):
    schedule = build(kind, n, m)
    order = schedule.to_torch()
    assert sorted(order) == list(range(n))
    assert all(isinstance(a, _Action) for lane in order.values() for a in lane)
    again = Schedule.from_torch(kind, order, n, m)
    assert again.lanes == schedule.lanes


def test_torch_1f1b_order_is_ipukit_1f1b():
    """torch's Schedule1F1B lists ipukit's 1F1B order, rank by rank.

    torch appends a REDUCE_GRAD per rank (ipukit steps on the host instead).
    torch 2.14.1 lists the last rank's forwards one micro-batch late ("3F1"
    first, "3F8" last with 8 micro-batches), a quirk of its listing only, so
    the last rank is compared as a set of backwards.
    """
    from torch.distributed.pipelining.schedules import Schedule1F1B

    class _Stage:  # what the schedule reads while building its order
        def __init__(self, n):
            self.num_stages, self.stage_index, self.is_first, self.is_last = n, 0, True, n == 1
            self.group_size, self.group_rank, self.submod = n, 0, None

    n, m = 4, 8
    order = Schedule1F1B(_Stage(n), n_microbatches=m).pipeline_order
    ours = build("1f1b", n, m).to_torch()
    for rank in range(n):
        theirs = [str(a) for a in order[rank]
                  if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
        mine = [str(a) for a in ours[rank]]
        if rank < n - 1:
            assert theirs == mine
        else:
            assert [t for t in theirs if "B" in t] == [t for t in mine if "B" in t]


def test_validate_finds_missing_duplicate_and_deadlock():
    good = build("1f1b", 2, 3).to_strings()
    missing = [lane[:] for lane in good]
    missing[1].remove("1B2")
    with pytest.raises(ScheduleError, match="'1B2' of iteration 0 is missing"):
        Schedule.from_strings("1f1b", missing, 2, 3)
    twice = [lane[:] for lane in good]
    twice[0].insert(0, "0F0")
    with pytest.raises(ScheduleError, match="in iteration 1"):  # a second 0F0 opens iteration 1
        Schedule.from_strings("1f1b", twice, 2, 3)
    # stage 0 waits for a gradient before sending the forward it depends on
    deadlock = [["0B0", "0F0", "0F1", "0F2", "0B1", "0B2", "0S"], good[1]]
    with pytest.raises(ScheduleError, match="deadlocks"):
        Schedule.from_strings("1f1b", deadlock, 2, 3)


def test_split_backward_rules():
    """I waits for the next stage's gradient, W for its own I; B = I + W when timed alike."""
    split = [["0F0", "0I0", "0W0", "0S"], ["1F0", "1I0", "1W0", "1S"]]
    full = [["0F0", "0B0", "0S"], ["1F0", "1B0", "1S"]]
    costs = {"F": [1.0, 1.0], "B": [2.0, 2.0], "I": [1.0, 1.0], "W": [1.0, 1.0]}
    s_split = Schedule.from_strings("zb", split, 2, 1)
    s_full = Schedule.from_strings("1f1b", full, 2, 1)
    t_split = walk(s_split.lanes, 2, costs)[0]
    t_full = walk(s_full.lanes, 2, costs)[0]
    # stage 0's input gradient starts when stage 1's input gradient ends (t = 3), not its W
    assert t_split[0][1] == (3.0, 4.0)
    assert t_split[1][1] == (2.0, 3.0) and t_split[1][2] == (3.0, 4.0)
    assert t_full[0][1] == (4.0, 6.0)


def test_core_limit_delays_and_unlimited_replicas_run_alike():
    s = build("gpipe", 2, 2)
    costs = {"F": [1.0, 1.0], "B": [1.0, 1.0]}
    free = walk(s.lanes, 2, costs, replicas=2)
    assert free[0] == free[1]
    one_core = walk(s.lanes, 2, costs, cores=1, replicas=2)
    ends = [t[1] for r in one_core for lane in r for t in lane]
    # 16 unit actions on one core: the last ends at 16, and no two overlap
    assert max(ends) == 16.0
    spans = sorted(t for r in one_core for lane in r for t in lane if t[1] > t[0])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv",
                                  "dualpipev", "looped-bfs"])
def test_a_core_per_worker_times_every_action_as_unlimited_cores(kind):
    """The two ways the walk runs (a core per worker, and a limit on cores) agree where the
    limit leaves every worker a core: same rules, same times, with uneven costs, split
    halves, transfers, steps and two iterations."""
    import random

    n = 4
    s = build(kind, n, 8, 2)
    rng = random.Random(kind)
    costs = {k: [rng.uniform(0.2, 3.0) for _ in range(n)] for k in "FBIWS"}
    transfers = {k: [rng.uniform(0.0, 0.5) for _ in range(n)] for k in "FB"}
    free = walk(s.lanes, n, costs, transfers, 0.25)
    limited = walk(s.lanes, n, costs, transfers, 0.25, cores=len(s.lanes))
    assert limited == free
